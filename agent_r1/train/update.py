"""The update phase: PPO's epochs over a step's mini-batches, one optimizer step each, and the
critic's step after the policy's on each mini-batch (docs/training.md, "One training step")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from agent_r1.algos import TokenFields, ValueObjective, aggregation_weights
from agent_r1.train import fault_injection
from agent_r1.train.batch import TrainBatch, hash_seed
from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import TrainConfig
from agent_r1.train.learner import MiniBatch, TokenLoss
from agent_r1.train.step_context import StepContext

__all__ = ["loss_weights", "ppo_update", "update"]

_CRITIC_NAMES = {
    "loss/policy": "loss/value",
    "grad_norm": "critic/grad_norm",
    "lr": "critic/lr",
    "update/skipped": "critic/update_skipped",
}


def loss_weights(mask_T: Tensor, tokens: TokenFields, config: TrainConfig) -> Tensor:
    """The configured loss aggregation (``algorithm.loss_aggregation``) as per-token weights over
    ``mask_T``'s tokens; sequences are steps (one response = one MDP action)."""
    aggregation = config.algorithm.loss_aggregation
    return aggregation_weights(
        mask_T,
        aggregation.name,
        seq_ids=tokens.step_ids,
        traj_ids=tokens.traj_ids,
        norm_len=aggregation.norm_len or float(config.rollout.max_tokens),
        equal_trajectory_weight=aggregation.equal_trajectory_weight,
    )


def update(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """The learning phase ``update`` (``agent_r1.train.phases``): the rollout engine sleeps (one GPU:
    it frees its memory for the update), then ``ppo_update``."""
    context.rollouts.sleep()
    metrics = ppo_update(
        context.learner, batch, context.step, context.config, context.objective, context.value_objective
    )
    return batch, metrics


def ppo_update(
    learner,
    batch: TrainBatch,
    step: int,
    config: TrainConfig,
    objective: TokenLoss,
    value_objective: ValueObjective,
) -> dict[str, float]:
    """``trainer.ppo_epochs`` passes over ``batch``'s mini-batches, in an order drawn per epoch by
    (seed, step, epoch), one optimizer step of ``learner`` (a learner backend) on ``objective`` each,
    then the critic's on ``value_objective`` when the learner has one. Returns the mean of each
    update's metrics (the critic's under their own names), the skipped updates and the seconds
    (``time/*``) summed, and the batch's token counts."""
    tokens = batch.tokens
    history: list[dict[str, float]] = []
    splits = len(batch.micro_batches)
    # A token the off-policy correction dropped leaves the loss and its denominators.
    keep_T = 1.0 if tokens.off_policy_keep is None else tokens.off_policy_keep
    for epoch in range(config.trainer.ppo_epochs):
        generator = torch.Generator().manual_seed(hash_seed(config.trainer.seed, step, epoch))
        order = torch.randperm(splits, generator=generator).tolist() if splits > 1 else [0]
        for j in order:
            in_mini_T = batch.mini_batch_masks[j]
            mask_T = tokens.mask * in_mini_T * keep_T
            weights_T = loss_weights(mask_T, tokens, config)
            mini = MiniBatch(batch.micro_batches[j], weights_T, replace(tokens, mask=mask_T))
            history.append(learner.update(mini, objective, with_entropy=True))
            fault_injection.after_optimizer_step(step, len(history))
            if learner.has_critic:
                history.append(
                    _critic_update(
                        learner, tokens, in_mini_T, batch.micro_batches[j], config, value_objective
                    )
                )
    keys = dict.fromkeys(key for h in history for key in h)
    # time/* (the learner's forward, backward and optimizer seconds, policy and critic) add up; a
    # maximum (*_max) stays one
    metrics = {
        key: (sum if key.startswith("time/") else max if key.endswith("_max") else _mean)(
            [h[key] for h in history if key in h]
        )
        for key in keys
    }
    metrics["update/skipped"] = sum(h["update/skipped"] for h in history if "update/skipped" in h)
    metrics["train/tokens"] = float(batch.train_tokens)
    metrics["train/tokens_per_step_layout"] = float(batch.step_layout_tokens)
    return metrics


def _critic_update(
    learner,
    tokens: TokenFields,
    in_mini_T: Tensor,
    micro_batches: Sequence[MicroBatch],
    config: TrainConfig,
    value_objective: ValueObjective,
) -> dict[str, float]:
    """The critic's step on the same mini-batch: the clipped value loss on the estimator's returns."""
    value_mask_T = tokens.value_mask * in_mini_T
    weights_T = loss_weights(value_mask_T, tokens, config)
    mini = MiniBatch(micro_batches, weights_T, replace(tokens, value_mask=value_mask_T))
    metrics = learner.update_critic(mini, value_objective)
    return {_CRITIC_NAMES.get(k, k): v for k, v in metrics.items()}


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")
