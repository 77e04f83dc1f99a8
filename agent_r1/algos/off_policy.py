"""Off-policy corrections: reweight or drop tokens the sampler produced with other probabilities than
the learner's behaviour policy, selected by name.

Inference engines and learners compute different log-probs (kernels, precision), and an asynchronous
or stale rollout was sampled by an older policy, so a token came from mu (the sampler), not from
pi_old (the learner's old policy) the PPO ratio is taken against. With the per-token ratio

    rho_t = pi_old(a_t) / mu(a_t) = exp(old_logprobs_t - sampler_logprobs_t)

every correction is ``fn(log_rho_T, mask_T, cfg, *, step_ids, traj_ids) -> (weight_T, keep_T)``,
registered in ``OFF_POLICY_CORRECTIONS``: the loss of token t is multiplied by ``weight_t``
(detached), and a token with ``keep_t`` False leaves the loss entirely — it is masked before the
aggregation, so it is not counted in any denominator either (the fix of slime PR 657 / verl PR 3915).

| name | weight | dropped | source |
|---|---|---|---|
| ``none`` | 1 | nothing | |
| ``tis`` | min(rho_t, tis_cap) | nothing | TIS, Yao et al. 2025 ("Your efficient RL framework secretly brings you off-policy RL training") |
| ``mis_step`` | rho_step = prod over the step's trained tokens of rho_t | the whole step when rho_step is outside [mis_low, mis_high] | sequence-level masked IS ("When Speed Kills Stability: Demystifying RL Collapse from the Training-Inference Mismatch", 2025), with steps as sequences |
| ``mis_trajectory`` | rho_traj = prod over the trajectory's trained tokens | the whole trajectory when outside [mis_low, mis_high] | the same, per episode |
| ``icepop`` | rho_t | tokens with rho_t outside [icepop_low, icepop_high] | IcePop (Ling team, the Ring-1T report, 2025) |

The trainer computes them once per step from the learner's recomputed old log-probs (a correction
other than ``none`` makes it recompute them), before the update. Metrics (over the trained tokens):
``off_policy/kl_k3`` = mean(rho - 1 - log rho), the k3 estimate of KL(mu || pi_old); the ratio's mean
and max; the weight's mean; the fraction of tokens dropped.

**The mismatch, whatever the correction** (``mismatch_metrics``): how far the sampler's log-probs are
from the learner's at the same tokens, ``mismatch/logprob_abs_mean`` and ``mismatch/logprob_abs_max``
(|learner - sampler| per trained token) and ``mismatch/kl_k3`` (the k3 estimate of KL(sampler ||
learner), the same quantity as ``off_policy/kl_k3``). Precision (a bf16 sampler against an fp32
learner), kernels and staleness all show here. Every step reports them wherever the learner's
log-probs at the sampled weights exist without an extra forward pass: the old log-probs when they are
recomputed (several updates per batch, or a correction), and the update's own forward with one
update per batch (the policy has not moved since the rollout). ``algorithm.old_logprobs: sampler``
with several updates per batch computes no learner log-probs before the update, so there it is not
reported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from agent_r1.algos.registry import InvalidOption, Registry
from agent_r1.algos.tokens import TokenFields

__all__ = [
    "OFF_POLICY_CORRECTIONS",
    "OffPolicyConfig",
    "correct_tokens",
    "get_off_policy_correction",
    "mismatch_metrics",
    "off_policy_correction",
    "register_off_policy_correction",
]


@dataclass(frozen=True)
class OffPolicyConfig:
    """The sampler/learner mismatch correction (each field documented once, here); the
    ``algorithm.off_policy`` config section (``off_policy: tis`` is short for ``{name: tis}``).

    name: the registered correction (``OFF_POLICY_CORRECTIONS``). Default ``none``.
    tis_cap: ``tis``'s cap C on the token weight (Yao et al. use 2).
    mis_low / mis_high: the kept range of ``mis_step`` / ``mis_trajectory``'s ratio (0.5 / 2, the
        range of slime's and verl's examples).
    icepop_low / icepop_high: the kept range of ``icepop``'s token ratio (IcePop's 0.5 / 5).
    """

    name: str = "none"
    tis_cap: float = 2.0
    mis_low: float = 0.5
    mis_high: float = 2.0
    icepop_low: float = 0.5
    icepop_high: float = 5.0

    def __post_init__(self) -> None:
        if self.tis_cap <= 0:
            raise InvalidOption("OffPolicyConfig", "tis_cap", f"must be > 0, got {self.tis_cap}")
        for low, high in (("mis_low", "mis_high"), ("icepop_low", "icepop_high")):
            if not 0 <= getattr(self, low) < 1 < getattr(self, high):
                raise InvalidOption(
                    "OffPolicyConfig",
                    high,
                    f"needs 0 <= {low} < 1 < {high}, got {getattr(self, low)} and {getattr(self, high)}",
                )


Correction = Callable[..., tuple[Tensor, Tensor]]
OFF_POLICY_CORRECTIONS: Registry[Correction] = Registry("off-policy correction")
register_off_policy_correction = OFF_POLICY_CORRECTIONS.register


def get_off_policy_correction(name: str) -> Correction:
    return OFF_POLICY_CORRECTIONS.lookup(name)


@register_off_policy_correction("none")
def no_correction(
    log_rho: Tensor, mask: Tensor, cfg: OffPolicyConfig, **ids: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.ones_like(log_rho), torch.ones_like(mask, dtype=torch.bool)


@register_off_policy_correction("tis")
def tis(log_rho: Tensor, mask: Tensor, cfg: OffPolicyConfig, **ids: Tensor) -> tuple[Tensor, Tensor]:
    return torch.clamp(torch.exp(log_rho), max=cfg.tis_cap), torch.ones_like(mask, dtype=torch.bool)


@register_off_policy_correction("icepop")
def icepop(log_rho: Tensor, mask: Tensor, cfg: OffPolicyConfig, **ids: Tensor) -> tuple[Tensor, Tensor]:
    rho = torch.exp(log_rho)
    return rho, (rho >= cfg.icepop_low) & (rho <= cfg.icepop_high)


@register_off_policy_correction("mis_step")
def mis_step(
    log_rho: Tensor, mask: Tensor, cfg: OffPolicyConfig, *, step_ids: Tensor, **ids: Tensor
) -> tuple[Tensor, Tensor]:
    return _masked_is(log_rho, mask, step_ids, cfg)


@register_off_policy_correction("mis_trajectory")
def mis_trajectory(
    log_rho: Tensor, mask: Tensor, cfg: OffPolicyConfig, *, traj_ids: Tensor, **ids: Tensor
) -> tuple[Tensor, Tensor]:
    return _masked_is(log_rho, mask, traj_ids, cfg)


def _masked_is(
    log_rho: Tensor, mask: Tensor, group_ids: Tensor, cfg: OffPolicyConfig
) -> tuple[Tensor, Tensor]:
    """The IS ratio of each group of tokens (a step, a trajectory): the product of its trained tokens'
    ratios, on each of its tokens; kept where it lies in [mis_low, mis_high]."""
    inverse = torch.unique(group_ids, return_inverse=True)[1]
    live_log_rho = torch.where(mask > 0, log_rho, torch.zeros_like(log_rho))
    summed = torch.zeros(int(inverse.max()) + 1 if inverse.numel() else 0, dtype=log_rho.dtype)
    group_rho = torch.exp(summed.index_add_(0, inverse, live_log_rho))[inverse]
    return group_rho, (group_rho >= cfg.mis_low) & (group_rho <= cfg.mis_high)


def off_policy_correction(
    old_logprobs: Tensor,
    sampler_logprobs: Tensor,
    mask: Tensor,
    cfg: OffPolicyConfig,
    *,
    step_ids: Tensor,
    traj_ids: Tensor,
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(weight_T, keep_T, metrics) of the configured correction on flat per-token tensors (T,); the
    weight is 0 wherever a token is dropped or masked."""
    for name, tensor in (("sampler_logprobs", sampler_logprobs), ("mask", mask), ("step_ids", step_ids)):
        if tensor.shape != old_logprobs.shape:
            raise ValueError(
                f"off-policy correction: {name} has shape {tuple(tensor.shape)}, old_logprobs have "
                f"{tuple(old_logprobs.shape)}"
            )
    live = mask > 0
    log_rho = torch.where(live, old_logprobs - sampler_logprobs, torch.zeros_like(old_logprobs)).detach()
    weight, keep = get_off_policy_correction(cfg.name)(
        log_rho, mask, cfg, step_ids=step_ids, traj_ids=traj_ids
    )
    keep = keep & live
    weight = torch.where(keep, weight, torch.zeros_like(weight))
    rho = torch.exp(log_rho[live])
    metrics: dict[str, float] = {}
    if rho.numel():
        metrics = {
            "off_policy/kl_k3": float((rho - 1 - log_rho[live]).mean()),
            "off_policy/ratio_mean": float(rho.mean()),
            "off_policy/ratio_max": float(rho.max()),
            "off_policy/weight_mean": float(weight[live].mean()),
            "off_policy/dropped_fraction": float(1 - keep[live].float().mean()),
        }
    return weight, keep, metrics


def mismatch_metrics(learner_logprobs: Tensor, sampler_logprobs: Tensor, mask: Tensor) -> dict[str, Tensor]:
    """``mismatch/*`` over the live (mask > 0) tokens: the mean and max |learner - sampler| log-prob
    and the k3 estimate of KL(sampler || learner); no metrics without a live token."""
    live = mask > 0
    if not bool(live.any()):
        return {}
    delta = (learner_logprobs.detach() - sampler_logprobs.detach())[live].float()
    return {
        "mismatch/logprob_abs_mean": delta.abs().mean(),
        "mismatch/logprob_abs_max": delta.abs().max(),
        "mismatch/kl_k3": (torch.exp(delta) - 1 - delta).mean(),
    }


def correct_tokens(tokens: TokenFields, cfg: OffPolicyConfig) -> tuple[TokenFields, dict[str, float]]:
    """The configured correction of a batch's per-token fields (``tokens.old_logprobs``, the learner's,
    against ``tokens.sampler_logprobs``): the fields with ``off_policy_weight`` and ``off_policy_keep``
    set, and the correction's metrics. ``cfg.name == "none"``: the fields unchanged, no metrics."""
    if cfg.name == "none":
        return tokens, {}
    weight_T, keep_T, metrics = off_policy_correction(
        tokens.old_logprobs,
        tokens.sampler_logprobs,
        tokens.mask,
        cfg,
        step_ids=tokens.step_ids,
        traj_ids=tokens.traj_ids,
    )
    return replace(tokens, off_policy_weight=weight_T, off_policy_keep=keep_T.float()), metrics
