"""Nothing computed for nothing: a micro-batch whose policy loss is provably zero (every advantage
zero, no KL or entropy term) is not forwarded, and the weights end exactly where forwarding it
would have left them (its gradient is exact zeros; the optimizer still steps on them)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from batching_support import random_trajectories

from agent_r1.algos import PolicyObjective, TokenFields, aggregation_weights
from agent_r1.algos.kl import KLConfig
from agent_r1.train.batch import batch_of
from agent_r1.train.config import ModelConfig, TrainerConfig
from agent_r1.train.learner import Learner, MiniBatch, load_policy


@dataclass(frozen=True)
class AlwaysForward:
    """Test double: the same objective without ``vanishes_at``, so the learner forwards every
    micro-batch (today's behaviour before the skip)."""

    objective: PolicyObjective

    def __call__(self, logprobs_K, entropy_K, tokens):
        return self.objective(logprobs_K, entropy_K, tokens)


def _mini_batch(advantages_of) -> MiniBatch:
    """One mini-batch of small micro-batches; ``advantages_of(traj_ids_T)`` gives the advantages."""
    batch = batch_of(random_trajectories(0, count=6), micro_batch_tokens=24)
    tokens = batch.tokens
    weights = aggregation_weights(tokens.mask, "token-mean", seq_ids=tokens.step_ids)
    fields = TokenFields(
        mask=tokens.mask,
        step_ids=tokens.step_ids,
        traj_ids=tokens.traj_ids,
        sampler_logprobs=tokens.sampler_logprobs,
        advantages=advantages_of(tokens.traj_ids),
    )
    return MiniBatch(batch.all_micro_batches, weights, fields)


def _train(tiny_checkpoint, objective, mini_batches) -> tuple[dict, list[dict]]:
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_checkpoint)))
    learner = Learner(model, TrainerConfig(lr=1e-3), temperature=1.0, total_optimizer_steps=10)
    metrics = [learner.update(mb, objective, with_entropy=True) for mb in mini_batches]
    return {n: p.detach().clone() for n, p in model.named_parameters()}, metrics


def test_zero_advantage_micro_batches_are_skipped_with_the_same_final_weights(tiny_checkpoint):
    some = _mini_batch(lambda traj_T: torch.where(traj_T % 2 == 0, 0.0, torch.sin(traj_T + 1.0)))
    learns = _mini_batch(lambda traj_T: torch.cos(traj_T.float()))
    nothing = _mini_batch(lambda traj_T: torch.zeros(traj_T.shape))
    # A step that learns first (Adam's moments are then non-zero), then one whose every advantage is
    # zero: the optimizer must still step on exact-zero gradients, as it did when forwarding them.
    updates = [some, learns, nothing, some]
    objective = PolicyObjective()
    skipped_weights, skipped = _train(tiny_checkpoint, objective, updates)
    forwarded_weights, forwarded = _train(tiny_checkpoint, AlwaysForward(objective), updates)

    for name, value in forwarded_weights.items():
        assert torch.equal(skipped_weights[name], value), name
    assert [m["loss/policy"] for m in skipped] == [m["loss/policy"] for m in forwarded]
    assert [m["grad_norm"] for m in skipped] == [m["grad_norm"] for m in forwarded]
    shares = [m["update/zero_loss_skipped"] for m in skipped]
    assert 0 < shares[0] < 1 and shares[1] == 0 and shares[2] == 1 and shares[3] == shares[0]
    assert all(m["update/zero_loss_skipped"] == 0 for m in forwarded)


@pytest.mark.parametrize(
    "objective",
    [PolicyObjective(entropy_coef=0.01), PolicyObjective(kl=KLConfig(coef=0.1, penalty="loss"))],
    ids=["entropy", "kl_loss"],
)
def test_a_loss_with_another_term_is_never_called_zero(objective):
    tokens = TokenFields(
        mask=torch.ones(4),
        step_ids=torch.zeros(4, dtype=torch.long),
        traj_ids=torch.zeros(4, dtype=torch.long),
        sampler_logprobs=torch.zeros(4),
        advantages=torch.zeros(4),
    )
    index_K, weights = torch.arange(4), torch.ones(4)
    assert PolicyObjective().vanishes_at(tokens, index_K, weights)
    assert not objective.vanishes_at(tokens, index_K, weights)
    # a non-zero advantage on a token of zero weight does not count; on a weighted one it does
    tokens_one = TokenFields(**{**tokens.__dict__, "advantages": torch.tensor([0.0, 0.0, 0.0, 1.0])})
    assert PolicyObjective().vanishes_at(tokens_one, index_K, torch.tensor([1.0, 1.0, 1.0, 0.0]))
    assert not PolicyObjective().vanishes_at(tokens_one, index_K, weights)
