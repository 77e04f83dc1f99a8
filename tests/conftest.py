"""Shared test fixtures: the tiny local checkpoint (built once per session) and hypothesis settings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    "agent-r1",
    deadline=None,  # shared 2-core machines: no timing assertions, in hypothesis either
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    max_examples=100,
)
settings.load_profile("agent-r1")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A folder holding the tiny Qwen2 model and its byte-level ChatML tokenizer, saved once."""
    from agent_r1.models.tiny import save_tiny_checkpoint

    return save_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_checkpoint):
    from agent_r1.models.loading import load_tokenizer

    return load_tokenizer(tiny_checkpoint)
