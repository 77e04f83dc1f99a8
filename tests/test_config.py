"""The typed config tree: YAML + dotted overrides; unknown keys and invalid values are rejected by name."""

from __future__ import annotations

import pytest
import yaml

from agent_r1.train.config import (
    ConfigError,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    dump_config,
    load_config,
)


def _yaml(tmp_path, data) -> str:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_yaml_and_overrides_build_the_typed_tree(tmp_path):
    path = _yaml(tmp_path, {"model": {"path": "m", "lora": {"rank": 8}}, "trainer": {"steps": 3, "lr": 1}})
    config = load_config(
        path,
        [
            "trainer.steps=7",
            "algorithm.kl.coef=0.01",
            "env.kwargs.turns=3",
            "model.lora.target_modules=[q_proj, v_proj]",
            "data.val=null",
        ],
    )
    assert isinstance(config, TrainConfig)
    assert config.model.path == "m" and config.model.lora.rank == 8
    assert config.trainer.steps == 7
    assert config.trainer.lr == 1.0 and isinstance(config.trainer.lr, float)  # int -> float
    assert config.algorithm.kl.coef == 0.01
    assert config.env.kwargs == {"turns": 3}
    assert config.model.lora.target_modules == ["q_proj", "v_proj"]
    assert config.data.val is None


def test_defaults_follow_the_papers():
    config = config_from_dict({})
    algo = config.algorithm
    assert algo.advantage.name == "grpo" and algo.policy_loss.name == "ppo_clip"
    assert algo.kl.coef == 0.0  # DAPO / Dr. GRPO: no KL term, no reference model
    assert (algo.policy_loss.clip_low, algo.policy_loss.clip_high) == (0.2, 0.28)  # DAPO clip-higher
    assert algo.loss_aggregation.name == "token-mean"


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, ["trainer.steps=4", "model.path=x"])
    dump_config(config, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == config
    assert config_from_dict(config_to_dict(config)) == config


@pytest.mark.parametrize(
    ("overrides", "key", "why"),
    [
        (["trainer.stepz=5"], "trainer.stepz", "did you mean 'steps'"),
        (["trainr.steps=5"], "trainr", "did you mean 'trainer'"),
        (["trainer.lr=-1"], "trainer.lr", "must be > 0"),
        (["trainer.steps=ten"], "trainer.steps", "must be an integer"),
        (["trainer.steps=2.5"], "trainer.steps", "must be an integer"),
        (["model.dtype=float16"], "model.dtype", "must be one of ['float32', 'bfloat16']"),
        (["logging.progress=maybe"], "logging.progress", "must be true or false"),
        (["rollout.top_p=0"], "rollout.top_p", "must be in (0, 1]"),
        (["rollout.n=1"], "rollout.n", "needs n >= 2"),
        (["algorithm.advantage=ppo"], "algorithm.advantage.name", "grpo"),
        (["algorithm.loss_aggregation=mean"], "algorithm.loss_aggregation.name", "token-mean"),
        (["algorithm.clip_high=0.3"], "algorithm.clip_high", "moved to 'algorithm.policy_loss.clip_high'"),
        (["algorithm.policy_loss.dual_clip=0.5"], "algorithm.policy_loss.dual_clip", "must be > 1"),
        (["algorithm.kl.penalty=both"], "algorithm.kl.penalty", "must be one of ['loss', 'reward']"),
        (["trainer.steps"], "trainer.steps", "key.subkey=value"),
        (["trainer.steps.x=1"], "trainer.steps.x", "is not a section"),
    ],
)
def test_bad_overrides_name_the_key_and_why(overrides, key, why):
    with pytest.raises(ConfigError) as info:
        load_config(None, overrides)
    assert info.value.key == key
    assert why in str(info.value)


def test_bad_yaml_values_and_sections_name_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'rollout.temperature': must be > 0"):
        load_config(_yaml(tmp_path, {"rollout": {"temperature": 0}}))
    with pytest.raises(ConfigError, match="'model': must be a mapping"):
        load_config(_yaml(tmp_path, {"model": "qwen"}))
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(_yaml(tmp_path, {"optimizer": {"lr": 1}}))


def test_example_configs_load():
    from pathlib import Path

    configs = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert load_config(path).env.name, path
