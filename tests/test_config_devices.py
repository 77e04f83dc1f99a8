"""Bad device, engine and attention-kernel settings: one clear error at start naming the key, the
value and what is available."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.trainer import Trainer

pytestmark = pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the errors of a machine without CUDA"
)


def _config(tiny_checkpoint, tmp_path, **model):
    return config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint), **model},
            "env": {"name": "trainer_envs:LowByteEnv"},
            "rollout": {"n": 2, "max_tokens": 4, "max_steps": 1},
            "trainer": {"steps": 1, "tasks_per_step": 2, "run_dir": str(tmp_path)},
            "logging": {"progress": False},
        }
    )


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_names_the_key_and_what_is_there(tiny_checkpoint, tmp_path, device):
    with pytest.raises(
        ConfigError,
        match=rf"'model.device': '{device}' asked for, but torch .* sees no CUDA device; available: 'cpu'",
    ):
        Trainer(_config(tiny_checkpoint, tmp_path, device=device))


def test_an_unknown_device_or_kernel_is_refused_by_the_config(tiny_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError, match=r"'model.device': must be 'auto', 'cpu', 'cuda' or 'cuda:N', got 'gpu'"
    ):
        _config(tiny_checkpoint, tmp_path, device="gpu")
    with pytest.raises(
        ConfigError, match=r"'model.attn_implementation'.*\['sdpa', 'eager', 'flash_attention_2'\]"
    ):
        _config(tiny_checkpoint, tmp_path, attn_implementation="flash")


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is not None, reason="flash-attn is installed")
def test_flash_attention_without_its_package_is_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError, match=r"'model.attn_implementation': 'flash_attention_2' needs the flash-attn"
    ):
        Trainer(_config(tiny_checkpoint, tmp_path, attn_implementation="flash_attention_2"))


def test_the_eager_kernel_is_loaded_when_asked_for(tiny_checkpoint, tmp_path):
    trainer = Trainer(_config(tiny_checkpoint, tmp_path, attn_implementation="eager", device="cpu"))
    try:
        assert trainer.model.config._attn_implementation == "eager"
        assert next(trainer.model.parameters()).device == torch.device("cpu")
    finally:
        trainer.close()


def test_vllm_without_vllm_installed_names_the_key_and_how_to_install_it(tiny_checkpoint, tmp_path):
    """The main environment has no vllm (the vLLM tier has its own .venv-vllm); tests/vllm on sys.path
    must not pass for the package."""
    config = config_from_dict({**_dict(tiny_checkpoint, tmp_path), "rollout": {"engine": "vllm", "n": 2}})
    with pytest.raises(
        ConfigError, match=r"'rollout.engine': the vllm package is not installed.*install_vllm.sh"
    ):
        Trainer(config)


def _dict(tiny_checkpoint, tmp_path):
    return {
        "model": {"path": str(tiny_checkpoint)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "trainer": {"steps": 1, "tasks_per_step": 2, "run_dir": str(tmp_path)},
    }
