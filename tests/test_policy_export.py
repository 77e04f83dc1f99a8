"""What the learner of several policies sends an engine that holds its own adapters (vLLM): each
trained adapter as peft would save it (``agent_r1.train.policies.export_adapters``), and the config
that asks for it (``rollout.engine: vllm`` with ``policies``)."""

from __future__ import annotations

import json

import torch
from safetensors.torch import load_file

from agent_r1.train.config import LoraConfig, ModelConfig, config_from_dict
from agent_r1.train.learner import load_policy
from agent_r1.train.policies import engine_roles, export_adapters


def test_each_adapter_is_exported_as_peft_saves_it(tiny_checkpoint, tmp_path):
    model = load_policy(
        ModelConfig(path=str(tiny_checkpoint), lora=LoraConfig(rank=4, alpha=8)), adapters=("low", "high")
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_()  # peft starts B at zero: every adapter would equal every other
    exported = export_adapters(model, ["low", "high"])
    model.save_pretrained(tmp_path)
    for adapter in ("low", "high"):
        saved = load_file(str(tmp_path / adapter / "adapter_model.safetensors"))
        tensors = exported[adapter].tensors
        assert set(tensors) == set(saved) and all(torch.equal(tensors[n], saved[n]) for n in saved)
        config = json.loads(json.dumps(exported[adapter].config))  # what the engine writes
        on_disk = json.loads((tmp_path / adapter / "adapter_config.json").read_text())
        for key in ("r", "lora_alpha", "peft_type", "use_rslora", "use_dora", "bias"):
            assert config[key] == on_disk[key], key
        assert sorted(config["target_modules"]) == sorted(on_disk["target_modules"])
    b = next(n for n in exported["low"].tensors if "lora_B" in n)
    assert not torch.equal(exported["low"].tensors[b], exported["high"].tensors[b])  # each its own


def test_several_policies_may_sample_with_vllm(tiny_checkpoint, tmp_path):
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint), "lora": {"rank": 4}},
            "rollout": {"engine": "vllm"},
            "trainer": {"run_dir": str(tmp_path)},
            "policies": {"low": {}, "high": {"frozen": True}},
        }
    )
    assert engine_roles(config) == {"low": "low", "high": None}
