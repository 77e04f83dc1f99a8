"""The errors of the OpenEnv adapter."""

from __future__ import annotations

__all__ = ["ActionRejected", "OpenEnvError"]


class OpenEnvError(RuntimeError):
    """The OpenEnv environment or its server failed: it died, hung past ``timeout_s``, raised, or
    cannot be reached. Raised into the rollout, which ends that trajectory with status ERROR."""


class ActionRejected(ValueError):
    """The environment's server refused the action as invalid (OpenEnv's VALIDATION_ERROR)."""
