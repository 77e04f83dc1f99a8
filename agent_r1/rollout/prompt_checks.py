"""The request checks every engine runs before it queues a request.

A prompt that no model can run (empty, a token id outside the vocabulary, no room left in the
context) fails alone, as a ``Completion`` that says why, instead of failing the batch it would join.
``HFEngine`` and ``VLLMEngine`` both ask ``refuse_prompt``, so they refuse the same prompts with the
same words. ``refuse_role`` does the same for a request's role (``SamplingParams.role``) in an
engine that serves several roles.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from agent_r1.types import Completion, StopReason

__all__ = ["refuse_prompt", "refuse_role"]


def refuse_prompt(prompt_ids: Sequence[int], *, vocab_size: int, max_context: int) -> Completion | None:
    """The ``Completion`` that refuses ``prompt_ids`` (``ABORT``, or ``LENGTH`` when the prompt fills
    the context), or None when a model of ``vocab_size`` tokens and ``max_context`` positions can
    run it."""
    if not prompt_ids:
        return Completion((), (), StopReason.ABORT, error="empty prompt: nothing to condition on")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        return Completion(
            (),
            (),
            StopReason.ABORT,
            error=f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
        )
    if len(prompt_ids) >= max_context:
        return Completion(
            (),
            (),
            StopReason.LENGTH,
            error=f"prompt has {len(prompt_ids)} tokens; the model's context is {max_context}",
        )
    return None


def refuse_role(engine: str, role: str | None, roles: Collection[str] | None) -> Completion | None:
    """The ``ABORT`` for a request of ``role`` in an engine that serves ``roles`` (naming them), or
    None when it serves it; ``roles`` None: the engine ignores roles (one policy)."""
    if roles is None or role in roles:
        return None
    served = f"this engine serves roles {sorted(roles)}"
    if role is None:
        error = f"SamplingParams.role is None; {served}: name one of them"
    else:
        error = f"unknown role {role!r}; {served}"
    return Completion((), (), StopReason.ABORT, error=f"{engine}: {error}")
