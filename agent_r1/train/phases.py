"""The learning phases of a training step: after the batch is built, each phase is a unit
``(batch, context) -> (batch, metrics)`` (``agent_r1.train.step_context``) that returns the batch
enriched with its per-token result (``TrainBatch.with_tokens``) and the metrics it measured.
``LEARNING_PHASES`` is their sequence; the trainer runs it in order and times each phase as
``time/<name>`` (docs/training.md, "One training step"). A phase lives with what it serves: the
critic's values in ``agent_r1.train.critic``, the teacher in ``agent_r1.train.teacher``, PPO's epochs
in ``agent_r1.train.update``; the algorithms they call are ``agent_r1.algos``' pure functions. A new
capability is a new phase and one line in the sequence, never a branch in the trainer.

A phase with nothing to do (no KL term, no critic, no teacher) returns the batch unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from agent_r1.algos import compute_advantages, correct_tokens, kl_reward_penalty, mismatch_metrics
from agent_r1.train import critic, teacher, update
from agent_r1.train.batch import TrainBatch
from agent_r1.train.config import TrainConfig
from agent_r1.train.step_context import Phase, StepContext

__all__ = ["LEARNING_PHASES", "advantages", "old_logprobs", "recomputes_old_logprobs", "reference"]


def recomputes_old_logprobs(config: TrainConfig, mini_batches: int) -> bool:
    """Whether ``old_logprobs`` runs the learner's forward for them: several updates per batch
    (``trainer.ppo_epochs`` x the batch's ``mini_batches``), or an off-policy correction, unless the
    sampler's stand in (``algorithm.old_logprobs: sampler``)."""
    algorithm = config.algorithm
    if algorithm.old_logprobs == "sampler":
        return False
    return config.trainer.ppo_epochs * mini_batches > 1 or algorithm.off_policy.name != "none"


def old_logprobs(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """PPO's old log-probs and (``algorithm.off_policy``) the off-policy correction
    (``agent_r1.algos.off_policy.correct_tokens``).

    With one optimizer step per batch the policy has not moved since the rollout: the old log-probs
    are the update's own, detached (``PolicyObjective``), so their extra forward pass is skipped
    unless the off-policy correction needs them first. Recomputed, they measure how far the sampler's
    log-probs are from the learner's (``mismatch/*``; otherwise the update's forward does)."""
    algorithm, mismatch = context.config.algorithm, {}
    if algorithm.old_logprobs == "sampler":
        batch = batch.with_tokens(old_logprobs=batch.tokens.sampler_logprobs)
    elif recomputes_old_logprobs(context.config, len(batch.micro_batches)):
        batch = batch.with_tokens(
            old_logprobs=context.learner.logprobs(batch.all_micro_batches, batch.num_tokens)
        )
        tokens = batch.tokens
        mismatch = {
            k: float(v)
            for k, v in mismatch_metrics(tokens.old_logprobs, tokens.sampler_logprobs, tokens.mask).items()
        }
    tokens, metrics = correct_tokens(batch.tokens, algorithm.off_policy)
    return replace(batch, tokens=tokens), {**metrics, **mismatch}


def reference(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """The frozen reference policy's log-probs, for the KL term (``algorithm.kl.coef > 0``)."""
    if context.config.algorithm.kl.coef <= 0:
        return batch, {}
    ref_T = context.learner.logprobs(batch.all_micro_batches, batch.num_tokens, reference=True)
    return batch.with_tokens(ref_logprobs=ref_T), {}


def advantages(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """The configured estimator (``algorithm.advantage``) on the batch's step table (with the
    learner's old log-probs and the critic's values, and for ``rae`` each role's running baseline)
    and, with ``algorithm.kl.penalty: reward``, the KL penalty in the rewards; the advantages and the
    critic's returns join the batch."""
    table, metrics = batch.step_table(), {}
    algorithm = context.config.algorithm
    if algorithm.kl.coef > 0 and algorithm.kl.penalty == "reward":
        table = kl_reward_penalty(table, algorithm.kl.coef, algorithm.kl.estimator)
    if context.needs.role_baseline:
        if context.baselines is None:
            raise ValueError(f"the {algorithm.advantage.name!r} estimator needs StepContext.baselines")
        roles = [trajectory.role for trajectory in batch.trajectories]
        table, metrics = context.baselines.apply(table, roles, algorithm.advantage.gamma)
    output = compute_advantages(table, algorithm.advantage)
    returns = output.returns[batch.valid_NL] if context.learner.has_critic else None
    return batch.with_tokens(advantages=output.advantages[batch.valid_NL], returns=returns), metrics


LEARNING_PHASES: tuple[tuple[str, Phase], ...] = (
    ("old_logprobs", old_logprobs),
    ("reference", reference),
    ("values", critic.values),
    ("advantage", advantages),
    ("teacher", teacher.distill),
    ("update", update.update),
)
"""The learning phases in order, each with the name it is timed and reported under."""
