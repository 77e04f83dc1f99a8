"""Several policies (issue 50) with an engine of its own (``rollout.share_model: false``).

The engine's copy holds every adapter; each weight sync copies in, by name, the adapters of the
policies that updated since the previous one (``PolicyLearners.weights``); the base never changes."""

from __future__ import annotations

import asyncio

import torch
from test_multi_policy import _policies_config
from trainer_envs import tasks

from agent_r1.flows.base import seeded_rollout_groups, split_roles
from agent_r1.rollout import HFEngine
from agent_r1.train.config import LoraConfig, ModelConfig
from agent_r1.train.learner import load_policy
from agent_r1.train.policies import adapter_of, by_policy, engine_roles
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams

LOGPROB_ATOL = 1e-4  # the engine-vs-learner parity of tests/test_rollout_hf.py and tests/test_trainer.py


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

    def recording(named_tensors, version=None):
        pairs = list(named_tensors)
        pushed.append((version, sorted({adapter_of(name) for name, _ in pairs})))
        take(pairs, version)

    engine.update_weights = recording
    trainer.fit()
    assert pushed == [(version, ["high", "low"]) for version in (1, 2, 3)]
    learner = dict(trainer.model.named_parameters())
    for name, value in engine.model.named_parameters():
        assert not value.requires_grad
        assert torch.equal(value, learner[name]), name
        if adapter_of(name) is None:
            assert torch.equal(value, base[name]), name

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
