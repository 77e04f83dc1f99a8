"""Several policies (issue 50) with an engine of its own (``rollout.share_model: false``), in async
mode, in deterministic mode and with on-policy distillation.

The engine's copy holds every adapter; each weight sync copies in, by name, the adapters of the
policies that updated since the previous one (``PolicyLearners.weights``); the base never changes."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_deterministic import VOLATILE, _dumps, _finish, _start
from test_multi_policy import _policies_config
from trainer_envs import tasks

from agent_r1.flows.base import seeded_rollout_groups, split_roles
from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.rollout import HFEngine
from agent_r1.train.config import LoraConfig, ModelConfig
from agent_r1.train.learner import load_policy
from agent_r1.train.policies import adapter_of, by_policy, engine_roles
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams

LOGPROB_ATOL = 1e-4  # the engine-vs-learner parity of tests/test_rollout_hf.py and tests/test_trainer.py


def _rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_engine_copy_holds_every_adapter_and_takes_those_that_updated(tiny_checkpoint, tmp_path):
    """``spare`` is a trained policy that no role maps to: it never updates, so no sync pushes it.
    After training the engine's adapters equal the learner's to the bit, its base is the base it
    started with, and it samples every role with the learner's log-probs."""
    config = _policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        policies={"low": {}, "high": {}, "spare": {}},
        rollout={"share_model": False},
        trainer={"checkpoint_every": 0},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    engine = trainer.rollouts.raw_engine
    assert not trainer.rollouts.shares_model and engine.model is not trainer.model
    assert set(engine.model.peft_config) == {"low", "high", "spare"}
    base = {n: p.detach().clone() for n, p in engine.model.named_parameters() if adapter_of(n) is None}
    pushed = []
    take = engine.update_weights

    def recording(adapters, version=None):
        pushed.append((version, sorted(adapters)))  # {adapter: LoraWeights}
        take(adapters, version)

    engine.update_weights = recording
    trainer.fit()
    assert pushed == [(version, ["high", "low"]) for version in (1, 2, 3)]
    learner = dict(trainer.model.named_parameters())
    for name, value in engine.model.named_parameters():
        assert not value.requires_grad
        assert torch.equal(value, learner[name]), name
        if adapter_of(name) is None:
            assert torch.equal(value, base[name]), name
    # a resumed run's engine copy starts from the base model's adapters: the restore pushes them all
    resumed = Trainer(config, train_tasks=tasks(4), resume=True)
    try:
        resumed._restore()
        restored = dict(resumed.rollouts.raw_engine.model.named_parameters())
        assert all(torch.equal(restored[n], value) for n, value in learner.items()), "stale adapters"
    finally:
        resumed.close()

    # a fresh engine over the copy (fit closed the run's): each role's sampled log-probs are its
    # policy's, as the learner recomputes them
    sampler = HFEngine(engine.model, tokenizer=trainer.tokenizer, roles=engine_roles(config))
    try:
        groups = asyncio.run(seeded_rollout_groups(trainer.rollouts.flow, sampler, tasks(2), 2, "parity"))
    finally:
        sampler.close()
    split = by_policy(config, split_roles(groups))
    assert [name for name, _ in split] == ["low", "high"]
    for name, policy_groups in split:
        batch = trainer.batch(policy_groups, 1)
        learner_T = trainer.learner.for_policy(name).logprobs(batch.all_micro_batches, batch.num_tokens)
        mask = batch.tokens.mask.bool()
        gap = (learner_T[mask] - batch.tokens.sampler_logprobs[mask]).abs().max()
        assert gap < LOGPROB_ATOL, (name, float(gap))


def test_an_update_of_any_adapter_empties_the_engines_stored_turns(tiny_checkpoint, tiny_tokenizer):
    """A stored turn is KV computed with its adapter's weights and the base's: a weight sync that
    writes any adapter (here the other role's) leaves no turn to reuse."""
    model = load_policy(
        ModelConfig(path=str(tiny_checkpoint), lora=LoraConfig(rank=4, alpha=8)), adapters=("low", "high")
    )
    engine = HFEngine(model.eval(), tokenizer=tiny_tokenizer, roles={"low": "low", "high": "high"})
    prompt = list(range(40, 52))

    def turn(ids):
        done = asyncio.run(engine.generate(ids, SamplingParams(max_tokens=4, role="low", seed=0)))
        return ids + list(done.token_ids) + [50, 51]

    try:
        second = turn(prompt)
        turn(second)
        assert engine.prefix_hits == 1
        name, tensor = next((n, p) for n, p in model.named_parameters() if adapter_of(n) == "high")
        engine.update_weights([(name, tensor.detach().clone())], version=1)
        turn(second)
        assert engine.prefix_hits == 1  # the stored turn was dropped, not reused
    finally:
        engine.close()


def test_async_mode_trains_every_policy(tiny_checkpoint, tmp_path):
    config = _policies_config(
        tiny_checkpoint,
        tmp_path / "run",
        rollout={"share_model": False},
        trainer={"mode": "async", "checkpoint_every": 0},
        algorithm={"off_policy": "tis"},
    )
    trainer = Trainer(config, train_tasks=tasks(6))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if adapter_of(n)}
    trainer.fit()
    rows = _rows(tmp_path / "run")
    for policy in ("low", "high"):
        trained = [r["step"] for r in rows if f"policy/{policy}/loss/policy" in r]
        assert trained == [1, 2, 3]
        moved = [
            n
            for n, p in trainer.model.named_parameters()
            if adapter_of(n) == policy and not torch.equal(p, before[n])
        ]
        assert moved
    # partial rollouts (the default) push every update at once: the engine ends with the last one
    engine = trainer.rollouts.raw_engine
    assert engine.weight_version == 3
    learner = dict(trainer.model.named_parameters())
    assert all(torch.equal(p, learner[n]) for n, p in engine.model.named_parameters())


def _policies_cli_config(tmp_path, checkpoint, **sections) -> str:
    tasks_file = tmp_path / "tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(t) + "\n" for t in tasks(4)))
    config = {
        "model": {"path": str(checkpoint), "lora": {"rank": 4, "alpha": 8}},
        "data": {"train": str(tasks_file), "required_fields": ["prompt"]},
        "env": {"name": "trainer_envs:LowHighEnv"},
        "rollout": {"n": 3, "max_tokens": 6, "max_steps": 2, "max_batch_size": 8},
        "trainer": {
            "steps": 3,
            "tasks_per_step": 2,
            "lr": 1e-2,
            "mini_batches": 2,
            "checkpoint_every": 0,
            "deterministic": True,
        },
        "logging": {"progress": False, "tensorboard": False, "report": False},
        "policies": {"low": {}, "high": {}},
    }
    for section, values in sections.items():
        config[section] = {**config.get(section, {}), **values}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _volatile(key: str) -> bool:
    """A wall-clock metric (tests/test_deterministic.py's ``VOLATILE``), also under a policy's or a
    role's prefix (``policy/<name>/time/optimizer``, ``role/<role>/time/generate_wait``)."""
    parts = key.split("/")
    if parts[0] in ("policy", "role") and len(parts) > 2:
        key = "/".join(parts[2:])
    return key.startswith(VOLATILE)


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode",
    [
        {},
        {
            "trainer": {"mode": "async", "partial_rollouts": False},
            "rollout": {"share_model": False},
            "algorithm": {"off_policy": "tis"},
        },
    ],
    ids=["sync", "async"],
)
def test_deterministic_reruns_of_several_policies_are_bitwise_equal(tiny_checkpoint, tmp_path, mode):
    """Two processes: every metric but the wall-clock ones, every trajectory dump and both policies'
    final adapter weights agree to the bit (tests/test_deterministic.py's comparison)."""
    config = _policies_cli_config(tmp_path, tiny_checkpoint, **mode)
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        _finish(_start(config, run))
    a, b = ([{k: v for k, v in r.items() if not _volatile(k)} for r in _rows(run)] for run in runs)
    assert a == b and len(a) == 3
    assert all(f"policy/{p}/loss/policy" in row for row in a for p in ("low", "high"))
    assert _dumps(runs[0]) == _dumps(runs[1]) and len(_dumps(runs[0])) == 3
    for policy in ("low", "high"):
        weights = [
            load_file(run / "checkpoints" / "step_000003" / "model" / policy / "adapter_model.safetensors")
            for run in runs
        ]
        assert weights[0].keys() == weights[1].keys() and weights[0]
        assert all(weights[0][n].equal(weights[1][n]) for n in weights[0]), policy


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory, tiny_tokenizer):
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("teacher") / "model", seed=7, tokenizer=tiny_tokenizer
    )


@pytest.mark.parametrize(
    "mode",
    [{}, {"trainer": {"mode": "async"}, "rollout": {"share_model": False}}],
    ids=["sync", "async"],
)
def test_distillation_trains_every_policy_against_the_teacher(
    tiny_checkpoint, teacher_checkpoint, tmp_path, mode
):
    """The teacher phase runs once per policy on its own batch: each logs its reverse KL."""
    sections = {
        "algorithm": {"distill": {"teacher": str(teacher_checkpoint)}, "old_logprobs": "sampler"},
        "trainer": {"checkpoint_every": 0, **mode.get("trainer", {})},
        "rollout": mode.get("rollout", {}),
    }
    trainer = Trainer(_policies_config(tiny_checkpoint, tmp_path / "run", **sections), train_tasks=tasks(6))
    trainer.fit()
    rows = _rows(tmp_path / "run")
    for policy in ("low", "high"):
        assert [r["step"] for r in rows if f"policy/{policy}/distill/reverse_kl" in r] == [1, 2, 3]
    assert all(r["time/teacher"] > 0 for r in rows if "time/teacher" in r)
