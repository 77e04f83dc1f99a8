"""Shared test fixtures: the tiny local checkpoint (built once per session), a local Ray cluster per
module, and hypothesis settings."""

from __future__ import annotations

from pathlib import Path

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


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """A local Ray cluster for one test module (2 CPUs, no dashboard), whose actors import this
    folder's modules (custom envs such as ``trainer_envs``)."""
    import ray

    from agent_r1.distributed import actor_runtime_env

    temp = tmp_path_factory.mktemp("r")
    tests = str(Path(__file__).parent)
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(temp), runtime_env=actor_runtime_env([tests]))
    yield
    ray.shutdown()
