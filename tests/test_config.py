"""The typed config tree: YAML + dotted overrides; unknown keys and invalid values are rejected by name,
every one at once; what trainer.mode: async needs is chosen where the config leaves it unset."""

from __future__ import annotations

import pytest
import yaml

from agent_r1.train.config import (
    ConfigError,
    ConfigErrors,
    TrainConfig,
    config_from_dict,
    config_from_dict_with_choices,
    config_to_dict,
    dump_config,
    load_config,
    load_config_with_choices,
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


# ---------------------------------------------------------------------------- every error at once


def test_every_error_of_a_config_is_listed_at_once(tmp_path):
    """Issue 65: one run lists every problem, overrides, fields and cross-field checks alike, in the
    order found; the whole is still a ConfigError, whose key and why are the first one's."""
    path = _yaml(
        tmp_path, {"model": {"dtype": "float16"}, "rollout": {"n": 1}, "trainer": {"stepz": 5, "lr": -1}}
    )
    with pytest.raises(ConfigErrors) as info:
        load_config(path, ["trainer.steps=ten", "logging.progres=false"])
    errors = info.value.errors
    assert [e.key for e in errors] == [
        "logging.progres",
        "model.dtype",
        "trainer.stepz",
        "trainer.steps",
        "trainer.lr",
        "rollout.n",
    ]
    assert isinstance(info.value, ConfigError)
    assert (info.value.key, info.value.why) == (errors[0].key, errors[0].why)
    assert str(info.value).splitlines() == ["6 configuration errors:", *(f"  {e}" for e in errors)]
    assert "did you mean 'progress'" in str(errors[0]) and "needs n >= 2" in str(errors[-1])


def test_a_single_error_keeps_its_own_message():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["trainer.lr=-1"])
    assert type(info.value) is ConfigError
    assert str(info.value) == "config key 'trainer.lr': must be > 0, got -1.0"


def test_a_cross_field_check_on_a_refused_value_is_skipped_and_the_others_run():
    """trainer.tasks_per_step refused: its default (8) stands in, and mini_batches would be judged
    against a batch nobody asked for, so that check is skipped; the independent betas check is not."""
    with pytest.raises(ConfigErrors) as info:
        config_from_dict({"trainer": {"tasks_per_step": "x", "mini_batches": 100, "betas": [0.9]}})
    assert [e.key for e in info.value.errors] == ["trainer.tasks_per_step", "trainer.betas"]


def test_each_refused_option_of_a_section_is_listed():
    with pytest.raises(ConfigErrors) as info:
        config_from_dict(
            {"algorithm": {"policy_loss": {"clip_low": 2, "dual_clip": 0.5}, "kl": {"coef": -1}}}
        )
    assert [e.key for e in info.value.errors] == [
        "algorithm.policy_loss.clip_low",
        "algorithm.policy_loss.dual_clip",
        "algorithm.kl.coef",
    ]


# ------------------------------------------------------------------- async: chosen and said once


def test_async_chooses_an_engine_copy_and_tis_and_says_so(tmp_path):
    """Issue 65: trainer.mode: async in one process with the HF engine needs rollout.share_model:
    false and an off-policy correction; left unset, both are chosen (docs/training.md, Asynchronous
    training) and said, one line each. The resolved config holds them: reloading it chooses nothing
    and compares equal, as a resume does."""
    path = _yaml(tmp_path, {"trainer": {"mode": "async"}})
    config, choices = load_config_with_choices(path)
    assert config.rollout.share_model is False and config.algorithm.off_policy.name == "tis"
    assert [c.split(" (")[0] for c in choices] == ["rollout.share_model: false", "algorithm.off_policy: tis"]
    assert "own copy of the weights" in choices[0] and "docs/algorithms.md" in choices[1]
    dump_config(config, tmp_path / "resolved.yaml")
    assert load_config_with_choices(tmp_path / "resolved.yaml") == (config, ())
    assert load_config(path) == config
    assert load_config_with_choices(None, ["trainer.mode=sync"])[1] == ()


@pytest.mark.parametrize(
    ("sections", "chosen", "share_model", "off_policy"),
    [
        (
            {"rollout": {"engine": "vllm"}},
            ["algorithm.off_policy: tis"],
            True,
            "tis",
        ),  # vLLM: its own weights
        ({"distributed": {"backend": "ray"}}, ["algorithm.off_policy: tis"], True, "tis"),
        ({"rollout": {"share_model": False}}, ["algorithm.off_policy: tis"], False, "tis"),
        ({"algorithm": {"off_policy": "icepop"}}, ["rollout.share_model: false"], False, "icepop"),
        ({"algorithm": {"old_logprobs": "sampler"}}, ["rollout.share_model: false"], False, "none"),
    ],
)
def test_async_chooses_only_what_the_config_left_unset(sections, chosen, share_model, off_policy):
    config, choices = config_from_dict_with_choices({"trainer": {"mode": "async"}, **sections})
    assert [c.split(" (")[0] for c in choices] == chosen
    assert (config.rollout.share_model, config.algorithm.off_policy.name) == (share_model, off_policy)


def test_async_chooses_tis_keeping_the_options_given():
    config = config_from_dict({"trainer": {"mode": "async"}, "algorithm": {"off_policy": {"tis_cap": 3}}})
    assert (config.algorithm.off_policy.name, config.algorithm.off_policy.tis_cap) == ("tis", 3.0)


@pytest.mark.parametrize(
    ("sections", "key", "words"),
    [
        ({"rollout": {"share_model": True}}, "rollout.share_model", "own copy of the weights"),
        ({"algorithm": {"off_policy": "none"}}, "trainer.mode", "correct for it with algorithm.off_policy"),
        (
            {"algorithm": {"old_logprobs": "learner"}},
            "trainer.mode",
            "correct for it with algorithm.off_policy",
        ),
    ],
)
def test_async_refuses_a_value_set_against_it_by_key(sections, key, words):
    with pytest.raises(ConfigError, match=words) as info:
        config_from_dict({"trainer": {"mode": "async"}, **sections})
    assert type(info.value) is ConfigError and info.value.key == key


def test_async_lists_both_refusals_at_once():
    """The report: three runs, each refused with one message; now one run names both keys."""
    with pytest.raises(ConfigErrors) as info:
        load_config(None, ["trainer.mode=async", "rollout.share_model=true", "algorithm.off_policy=none"])
    assert [e.key for e in info.value.errors] == ["rollout.share_model", "trainer.mode"]
