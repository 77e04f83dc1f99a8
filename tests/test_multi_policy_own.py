"""A policy with a model of its own (issue 50, item 1: ``policies.<name>.path``).

Beside the policies that are adapters on the shared base, a policy may hold another model (another
size, other weights) that shares the run's tokenizer: trained, a LoRA adapter of its name on that
model with its own optimizer, sampled by an HF engine of its own; frozen, the model as it is. Its
checkpoint is its adapter beside the others'; a resume and ``agent-r1 eval --checkpoint`` load it."""

from __future__ import annotations

import json

import pytest
import torch
from test_multi_policy import _adapter, _policies_config, tasks

from agent_r1.models.loading import load_tokenizer, save_model
from agent_r1.models.tiny import build_tiny, save_tiny_checkpoint
from agent_r1.train.config import ConfigError
from agent_r1.train.policies import check_own_models
from agent_r1.train.trainer import Trainer


@pytest.fixture(scope="module")
def other_model(tmp_path_factory):
    """A second tiny model, smaller and differently seeded, saved with the run's tokenizer."""
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("other") / "model", seed=7, hidden_size=64, num_layers=2
    )


@pytest.mark.parametrize(
    ("change", "key", "words"),
    [
        (
            {"policies": {"low": {}, "high": {"path": "X", "adapter": "Y"}}},
            "policies.high.adapter",
            "not both",
        ),
        (
            {"policies": {"low": {}, "high": {"path": "X"}}, "rollout": {"engine": "vllm"}},
            "rollout.engine",
            "hf",
        ),
        (
            {"policies": {"low": {}, "high": {"path": "X"}}, "rollout": {"share_model": False}},
            "rollout.share_model",
            "shares",
        ),
        ({"policies": {"low": {"path": "X"}, "high": {"path": "Y"}}}, "policies.low", "shared base"),
    ],
)
def test_a_model_of_its_own_is_refused_where_it_cannot_run(tiny_checkpoint, tmp_path, change, key, words):
    with pytest.raises(ConfigError, match=words) as error:
        _policies_config(tiny_checkpoint, tmp_path, **change)
    assert error.value.key == key


def test_a_model_of_its_own_must_share_the_run_s_tokenizer(tiny_checkpoint, tiny_tokenizer, tmp_path):
    """Checked from the tokenizer files, before any weights load: an episode is tokenized once for
    every role, so another vocabulary or chat template would feed a model ids it does not know."""
    missing = _policies_config(
        tiny_checkpoint, tmp_path, policies={"low": {}, "high": {"path": str(tmp_path / "no")}}
    )
    with pytest.raises(ConfigError, match="is not a folder") as error:
        check_own_models(missing, tiny_tokenizer)
    assert error.value.key == "policies.high.path"
    tokenizer = load_tokenizer(tiny_checkpoint)
    tokenizer.add_tokens(["<|extra|>"])
    model, _ = build_tiny(tokenizer=tokenizer, hidden_size=64, num_layers=2)
    save_model(model, tokenizer, tmp_path / "wider")
    wider = _policies_config(
        tiny_checkpoint, tmp_path, policies={"low": {}, "high": {"path": str(tmp_path / "wider")}}
    )
    with pytest.raises(ConfigError, match="another vocabulary") as error:
        check_own_models(wider, tiny_tokenizer)
    assert error.value.key == "policies.high.path"


def test_a_policy_with_a_model_of_its_own_trains_it_and_resumes(tiny_checkpoint, other_model, tmp_path):
    config = _policies_config(
        tiny_checkpoint, tmp_path / "run", policies={"low": {}, "high": {"path": str(other_model)}}
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    own = trainer.learner.policy.own_models["high"]
    assert own is not trainer.model and own.config.hidden_size == 64 and set(own.peft_config) == {"high"}
    assert set(trainer.model.peft_config) == {"low"}  # no adapter of "high" on the shared base
    assert trainer.rollouts.raw_engine.routes["high"].model is own  # its own engine samples "high"
    low0, high0 = _adapter(trainer.model, "low"), _adapter(own, "high")
    metrics = trainer.fit()
    for role in ("low", "high"):
        assert f"role/{role}/reward/mean" in metrics and f"policy/{role}/grad_norm" in metrics
    low, high = _adapter(trainer.model, "low"), _adapter(own, "high")
    assert any(not torch.equal(low[n], low0[n]) for n in low)
    assert any(not torch.equal(high[n], high0[n]) for n in high)
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000003"
    saved = json.loads((checkpoint / "model" / "high" / "adapter_config.json").read_text())
    assert saved["base_model_name_or_path"] == str(other_model)
    resumed = Trainer(config, train_tasks=tasks(4), resume=True)
    try:
        resumed._restore()
        resumed_own = resumed.learner.policy.own_models["high"]
        for name, value in _adapter(resumed_own, "high").items():
            assert torch.equal(value, high[name]), name
        for name, value in _adapter(resumed.model, "low").items():
            assert torch.equal(value, low[name]), name
        saved_state = trainer.learner.policy.learners["high"].state_dict()
        loaded_state = resumed.learner.policy.learners["high"].state_dict()
        assert saved_state["optimizer_steps"] == loaded_state["optimizer_steps"] == 3
    finally:
        resumed.close()


def test_a_frozen_model_of_its_own_plays_and_never_moves(tiny_checkpoint, other_model, tmp_path):
    config = _policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        policies={"low": {}, "high": {"path": str(other_model), "frozen": True}},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    frozen = trainer.rollouts.raw_engine.routes["high"].model
    assert not hasattr(frozen, "peft_config") and frozen.config.hidden_size == 64
    before = {n: p.detach().clone() for n, p in frozen.named_parameters()}
    metrics = trainer.fit()
    assert "role/high/reward/mean" in metrics and not any(k.startswith("policy/high/") for k in metrics)
    assert all(torch.equal(p, before[n]) for n, p in frozen.named_parameters())


def test_eval_of_a_checkpoint_samples_each_policy_s_own_model(tiny_checkpoint, other_model, tmp_path, capsys):
    """``agent-r1 eval --checkpoint`` loads the own model's trained adapter too: the checkpoint holds
    the trained weights, and the command prints the metrics of evaluating the trained objects (one
    request at a time, so that both sample the same tokens)."""
    from agent_r1.cli import main
    from agent_r1.train.builders import load_own_models
    from agent_r1.train.checkpoint import load_checkpoint
    from agent_r1.train.config import dump_config
    from agent_r1.train.evaluation import evaluate
    from agent_r1.train.policies import policy_model

    val = tmp_path / "val.jsonl"
    val.write_text("".join(json.dumps(t) + "\n" for t in tasks(3)))
    config = _policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        policies={"low": {}, "high": {"path": str(other_model)}},
        data={"val": str(val)},
        rollout={"eval_n": 2, "max_batch_size": 1, "engine_kwargs": {"prefix_cache_entries": 0}},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    trainer.fit()
    own = trainer.learner.policy.own_models
    checkpoint = tmp_path / "run" / "checkpoints" / "step_000003"
    fresh = load_own_models(config)["high"]
    untrained = _adapter(fresh, "high")
    load_checkpoint(checkpoint, policy_model(config), own_models={"high": fresh})
    trained, loaded = _adapter(own["high"], "high"), _adapter(fresh, "high")
    assert all(torch.equal(loaded[n], value) for n, value in trained.items())
    assert any(not torch.equal(untrained[n], value) for n, value in trained.items())  # it had moved
    expected = evaluate(config, tokenizer=trainer.tokenizer, model=trainer.model, own_models=own)
    path = tmp_path / "config.yaml"
    dump_config(config, path)
    assert main(["eval", str(path), "--checkpoint", str(checkpoint)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (
        printed == expected
        and printed["eval/episodes"] == 3 * 2
        and printed["eval/trajectories"] == 3 * 2 * 2
    )
