"""The per-token objectives a learner minimises: small, picklable callables built from the config.

A learner (in this process, or each worker of a Ray learner group) calls an objective as
``objective(outputs_K, entropy_K, tokens) -> (loss_K, stats)`` on a micro-batch's scored tokens, with
the batch's per-token fields gathered to them (``tokens``: a ``TokenFields``, ``tokens.advantages``,
``tokens.mask``, ``tokens.old_logprobs``...). Because an objective is plain data plus a ``__call__``,
it travels to remote workers as it is: any picklable callable of that signature — a custom one
included — trains on Ray exactly as in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.algos.kl import KLConfig, kl_penalty
from agent_r1.algos.off_policy import mismatch_metrics
from agent_r1.algos.policy_losses import PolicyLossConfig, get_policy_loss
from agent_r1.algos.tokens import TokenFields
from agent_r1.algos.value_losses import clipped_value_loss

__all__ = ["PolicyObjective", "ValueObjective"]


@dataclass(frozen=True)
class PolicyObjective:
    """The per-token policy objective: the registered policy loss ``loss.name`` (with ``loss``'s
    settings, times ``tokens.off_policy_weight`` when the trainer corrects for the sampler) +
    ``kl.coef`` x KL to the reference (GRPO's KL loss term, estimator ``kl.estimator``; only with
    ``kl.penalty: loss`` — the reward penalty is applied to the advantages instead) - ``entropy_coef``
    x entropy (the entropy bonus of Mnih et al. 2016, arXiv 1602.01783; LLM RL usually keeps 0 and
    only logs the entropy), on the live (mask > 0) tokens.

    With ``tokens.old_logprobs`` None (one optimizer step per batch: the policy has not moved since
    the rollout) the old log-probs are the new ones, detached, so the first ratio is exactly 1.

    ``measure_mismatch``: every call is at the weights that sampled (one update per batch), so the
    stats add how far the sampler's log-probs are from these (``mismatch/*``,
    ``agent_r1.algos.off_policy.mismatch_metrics``; a ``*_max`` stat is combined by its maximum, the
    others by their token-weighted mean)."""

    loss: PolicyLossConfig = PolicyLossConfig()
    kl: KLConfig = KLConfig()
    entropy_coef: float = 0.0
    measure_mismatch: bool = False

    @property
    def uses_reference(self) -> bool:
        return self.kl.coef > 0 and self.kl.penalty == "loss"

    def vanishes_at(self, tokens: TokenFields, index_K: Tensor, weights: Tensor) -> bool:
        """Whether the loss is exactly zero on the tokens ``index_K`` (of the batch's flat order), so
        that a learner may skip their forward and backward passes: every policy loss is the advantage
        times a function of the ratio, so it vanishes where every weighted token's advantage is zero
        and no KL or entropy term is added."""
        if self.uses_reference or self.entropy_coef != 0 or tokens.advantages is None:
            return False
        live_K = weights[index_K] != 0
        return not bool((tokens.advantages[index_K][live_K] != 0).any())

    def __call__(
        self, logprobs_K: Tensor, entropy_K: Tensor | None, tokens: TokenFields
    ) -> tuple[Tensor, dict[str, float]]:
        old_logprobs_K = logprobs_K.detach() if tokens.old_logprobs is None else tokens.old_logprobs
        mismatch = {}
        if self.measure_mismatch:  # the learner at the weights that sampled: what they differ by
            mismatch = mismatch_metrics(logprobs_K, tokens.sampler_logprobs, tokens.mask)
        loss_K, stats = get_policy_loss(self.loss.name)(
            logprobs_K,
            old_logprobs_K,
            tokens.advantages,
            tokens.mask,
            self.loss,
            seq_ids=tokens.step_ids,
        )
        if tokens.off_policy_weight is not None:  # the off-policy correction (agent_r1.algos.off_policy)
            loss_K = loss_K * tokens.off_policy_weight
        live_K = tokens.mask > 0
        denom = live_K.sum().clamp(min=1)
        if self.uses_reference:
            kl_K = kl_penalty(logprobs_K, tokens.ref_logprobs, self.kl.estimator)
            loss_K = loss_K + self.kl.coef * torch.where(live_K, kl_K, torch.zeros_like(kl_K))
            stats["kl/mean"] = (kl_K.detach() * live_K).sum() / denom
        if entropy_K is not None:
            if self.entropy_coef > 0:
                loss_K = loss_K - self.entropy_coef * torch.where(
                    live_K, entropy_K, torch.zeros_like(entropy_K)
                )
            stats["entropy/mean"] = (entropy_K.detach() * live_K).sum() / denom
        return loss_K, {name: float(v) for name, v in {**stats, **mismatch}.items()}


@dataclass(frozen=True)
class ValueObjective:
    """``coef`` x PPO's clipped value loss of the critic's values against ``tokens.returns`` on the
    tokens of ``tokens.value_mask`` (``clip``: the value clip range; None = unclipped)."""

    coef: float = 0.5
    clip: float | None = 0.2

    def __call__(
        self, values_K: Tensor, entropy_K: Tensor | None, tokens: TokenFields
    ) -> tuple[Tensor, dict[str, float]]:
        loss_K, stats = clipped_value_loss(
            values_K, tokens.old_values, tokens.returns, tokens.value_mask, clip=self.clip
        )
        return self.coef * loss_K, {f"critic/{name}": float(v) for name, v in stats.items()}
