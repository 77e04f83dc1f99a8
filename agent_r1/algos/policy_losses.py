"""Policy losses, per token, selected by name.

Every loss is ``fn(logprobs, old_logprobs, advantages, mask, cfg, *, seq_ids=None) ->
(loss_per_token, metrics)``, registered in ``POLICY_LOSSES``. Tensors have
any identical shape (the learner passes packed rows, (B, T)); ``loss_per_token`` has that shape and is
exactly 0 where ``mask`` is 0, and no gradient reaches a masked token even if its inputs are inf/NaN.
Aggregate it with ``agent_r1.algos.aggregation``. ``metrics`` are detached scalars averaged over this
call's masked tokens (average them over micro-batches for logging).

- ``logprobs``: the learner's current log-probs (with gradient).
- ``old_logprobs``: the behaviour policy's log-probs, fixed for the update (the learner's recomputation
  at the start of the step, or the sampler's when not recomputed).
- ``seq_ids``: which "sequence" (step) each token belongs to, for ``gspo``.

The whole per-token objective (this loss x the off-policy correction's weight + KL to the reference +
the entropy bonus) is ``agent_r1.algos.objective.PolicyObjective``; the sampler/learner mismatch
corrections (TIS, masked IS, IcePop): ``agent_r1.algos.off_policy``; KL estimators:
``agent_r1.algos.kl``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.algos.registry import InvalidOption, Registry

__all__ = [
    "POLICY_LOSSES",
    "PolicyLoss",
    "PolicyLossConfig",
    "get_policy_loss",
    "register_policy_loss",
]


@dataclass(frozen=True)
class PolicyLossConfig:
    """Settings of the policy losses (each field documented once, here); the ``algorithm.policy_loss``
    config section (``algorithm.policy_loss: gspo`` is short for ``{name: gspo}``).

    name: the registered loss (``POLICY_LOSSES``). Default ``ppo_clip``.
    clip_low / clip_high: ``ppo_clip`` clips the ratio to [1 - clip_low, 1 + clip_high]. PPO's 0.2
        (Schulman et al. 2017) below; above, DAPO's clip-higher 0.28 (arXiv 2503.14476).
    dual_clip: c > 1 bounds the loss of negative-advantage tokens by -c * A (Ye et al. 2020,
        arXiv 1912.09729; c = 3 there). None (default) = off.
    gspo_clip_low / gspo_clip_high: ``gspo``'s sequence-ratio clip range (the GSPO paper's 3e-4 / 4e-4,
        arXiv 2507.18071). GSPO's "sequence" is one step (one response, the MDP action): the trainer
        passes step ids.
    cispo_ratio_min / cispo_ratio_max: ``cispo`` clips its detached IS weight to [min, max]. MiniMax-M1
        (arXiv 2506.13585) leaves the low side open and tunes the high side; the defaults 0 / 4 are
        Tinker's (tinker-docs.thinkingmachines.ai/tinker/losses/cispo).
    """

    name: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.28
    dual_clip: float | None = None
    gspo_clip_low: float = 3e-4
    gspo_clip_high: float = 4e-4
    cispo_ratio_min: float = 0.0
    cispo_ratio_max: float = 4.0

    def __post_init__(self) -> None:
        for name in ("clip_low", "gspo_clip_low"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise InvalidOption("PolicyLossConfig", name, f"must be in [0, 1), got {getattr(self, name)}")
        for name in ("clip_high", "gspo_clip_high"):
            if getattr(self, name) < 0.0:
                raise InvalidOption("PolicyLossConfig", name, f"must be >= 0, got {getattr(self, name)}")
        if self.dual_clip is not None and self.dual_clip <= 1.0:
            raise InvalidOption(
                "PolicyLossConfig", "dual_clip", f"must be > 1 (or null), got {self.dual_clip}"
            )
        if self.cispo_ratio_min < 0.0:
            raise InvalidOption(
                "PolicyLossConfig", "cispo_ratio_min", f"must be >= 0, got {self.cispo_ratio_min}"
            )
        if self.cispo_ratio_max <= self.cispo_ratio_min:
            raise InvalidOption(
                "PolicyLossConfig",
                "cispo_ratio_max",
                f"must be > cispo_ratio_min ({self.cispo_ratio_min}), got {self.cispo_ratio_max}",
            )


PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: Registry[PolicyLoss] = Registry("policy loss")
register_policy_loss = POLICY_LOSSES.register


def get_policy_loss(name: str) -> PolicyLoss:
    return POLICY_LOSSES.lookup(name)


@register_policy_loss("ppo_clip")
def ppo_clip(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv 1707.06347), with DAPO's decoupled
    clip range and optional dual clip:

        r = pi / pi_old,  l = max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))
        dual clip (A < 0): l = min(l, -c A)
    """
    live, log_ratio, adv = _inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": _masked_mean((clipped > unclipped).float(), live)}
    if cfg.dual_clip is not None:
        bound = -adv * cfg.dual_clip
        dual = (adv < 0) & (loss > bound)
        loss = torch.where(dual, bound, loss)
        metrics["dual_clip_fraction"] = _masked_mean(dual.float(), live)
    metrics.update(_ratio_metrics(log_ratio, live))
    return _finish(loss, live, metrics)


@register_policy_loss("gspo")
def gspo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071), token form ("GSPO-token"):

        s_i = exp(mean_{t in i} log(pi_t / pi_old_t))          (sequence ratio, length-normalised)
        s_it = sg(s_i) * pi_t / sg(pi_t),   l_t = max(-A_t s_it, -A_t clip(s_it, 1 - gspo_clip_low, 1 + gspo_clip_high))

    s_it equals s_i in value and passes the sequence's gradient to each token; with an advantage
    constant over the sequence and ``seq-mean-token-mean`` aggregation it is exactly GSPO. Sequences
    are named by ``seq_ids`` (the trainer passes step ids: one response is one sequence); without them
    each row of the leading dimensions is a sequence. s_i is computed from the tokens of this call, so
    all tokens of a sequence must be in the same call (micro-batch): true for steps, which are never
    split across micro-batches. (Trajectory-level sequences would need every step of a trajectory in
    one micro-batch, which packing does not guarantee, so they are not offered.)
    """
    live, log_ratio, adv = _inputs(logprobs, old_logprobs, advantages, mask)
    if seq_ids is None:
        seq_ids = torch.arange(live[..., 0].numel(), device=live.device).reshape(live.shape[:-1])[..., None]
        seq_ids = seq_ids.expand(live.shape)
    if seq_ids.shape != live.shape:
        raise ValueError(f"gspo: seq_ids has shape {tuple(seq_ids.shape)}, logprobs have {tuple(live.shape)}")
    seq_X = torch.unique(seq_ids.reshape(-1), return_inverse=True)[1].reshape(live.shape)
    live_f = live.to(log_ratio.dtype)
    sums = torch.zeros(
        int(seq_X.max()) + 1 if seq_X.numel() else 0, dtype=log_ratio.dtype, device=live.device
    )
    counts = torch.zeros_like(sums).index_add_(0, seq_X.reshape(-1), live_f.reshape(-1))
    sums = sums.index_add_(0, seq_X.reshape(-1), log_ratio.detach().reshape(-1))
    seq_log_ratio = (sums / counts.clamp(min=1))[seq_X]
    safe_logprobs = torch.where(live, logprobs, torch.zeros_like(logprobs))
    token_ratio = torch.exp(seq_log_ratio + safe_logprobs - safe_logprobs.detach())
    unclipped = -adv * token_ratio
    clipped = -adv * torch.clamp(token_ratio, 1.0 - cfg.gspo_clip_low, 1.0 + cfg.gspo_clip_high)
    loss = torch.maximum(unclipped, clipped)
    metrics = {"clip_fraction": _masked_mean((clipped > unclipped).float(), live)}
    metrics.update(_ratio_metrics(log_ratio, live))
    seq_live = counts > 0
    metrics["seq_ratio_mean"] = torch.exp(sums / counts.clamp(min=1))[seq_live].mean()
    return _finish(loss, live, metrics)


@register_policy_loss("cispo")
def cispo(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update.

        l_t = -sg(clip(r_t, cispo_ratio_min, cispo_ratio_max)) * A_t * log pi_t

    Every token keeps a gradient (PPO's clip zeroes it outside the range); the weight is bounded.
    """
    live, log_ratio, adv = _inputs(logprobs, old_logprobs, advantages, mask)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, cfg.cispo_ratio_min, cfg.cispo_ratio_max).detach()
    loss = -weight * adv * torch.where(live, logprobs, torch.zeros_like(logprobs))
    outside = (ratio < cfg.cispo_ratio_min) | (ratio > cfg.cispo_ratio_max)
    metrics = {"clip_fraction": _masked_mean(outside.float(), live)}
    metrics.update(_ratio_metrics(log_ratio, live))
    return _finish(loss, live, metrics)


@register_policy_loss("reinforce", single_update=True)
def reinforce(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    seq_ids: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """REINFORCE (Williams 1992): l_t = -A_t * log pi_t, no ratio and no clip.

    Correct only on-policy (one gradient step per batch); an off-policy correction still corrects the
    sampler/learner mismatch. ``old_logprobs`` feed the metrics only.
    """
    live, log_ratio, adv = _inputs(logprobs, old_logprobs, advantages, mask)
    loss = -adv * torch.where(live, logprobs, torch.zeros_like(logprobs))
    return _finish(loss, live, _ratio_metrics(log_ratio, live))


def _inputs(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The live-token mask, the log-ratio and the advantages, zeroed where the mask is 0."""
    for name, tensor in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask)):
        if tensor.shape != logprobs.shape:
            raise ValueError(
                f"policy loss: {name} has shape {tuple(tensor.shape)}, logprobs have {tuple(logprobs.shape)}"
            )
    live = mask > 0
    zero = torch.zeros_like(logprobs)
    log_ratio = torch.where(live, logprobs - old_logprobs.detach(), zero)
    adv = torch.where(live, advantages.detach().to(logprobs.dtype), zero)
    return live, log_ratio, adv


def _finish(loss: Tensor, live: Tensor, metrics: dict[str, Tensor]) -> tuple[Tensor, dict[str, Tensor]]:
    """Zero the masked tokens and detach the metrics."""
    loss = torch.where(live, loss, torch.zeros_like(loss))
    return loss, {name: value.detach() for name, value in metrics.items()}


def _ratio_metrics(log_ratio: Tensor, live: Tensor) -> dict[str, Tensor]:
    """ratio_mean, ratio_max and approx_kl = mean((r - 1) - log r) (the k3 estimator of KL(pi_old || pi))."""
    log_ratio = log_ratio.detach()
    ratio = torch.exp(log_ratio)
    return {
        "ratio_mean": _masked_mean(ratio, live),
        "ratio_max": ratio[live].max() if live.any() else ratio.new_zeros(()),
        "approx_kl": _masked_mean(ratio - 1.0 - log_ratio, live),
    }


def _masked_mean(values: Tensor, live: Tensor) -> Tensor:
    live_f = live.to(values.dtype)
    return (values * live_f).sum() / live_f.sum().clamp(min=1)
