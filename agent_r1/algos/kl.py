"""KL divergence to the reference policy, per token: k1, k2, k3 estimators, as a loss or a reward penalty.

With samples from pi and log-ratio x = log pi - log pi_ref (Schulman, "Approximating KL divergence",
joschu.net/blog/kl-approx.html):

| kind | per token | notes |
|---|---|---|
| ``k1`` | x | unbiased for KL(pi || ref), high variance, can be negative |
| ``k2`` | x^2 / 2 | biased, low variance, always >= 0 |
| ``k3`` | exp(-x) - 1 + x | unbiased, low variance, always >= 0 (GRPO's estimator, arXiv 2402.03300) |

Two ways to use it (``KLConfig.penalty`` picks one; never both for the same beta):

- **Loss term** (GRPO): ``loss = pg_loss + beta * aggregate(kl_penalty(logprobs, ref_logprobs, kind, mask=mask), ...)``
  with the learner's current ``logprobs``. On-policy, the gradient of the k2 term is the gradient of
  KL(pi || ref); the k3 term's gradient is that of KL(ref || pi); the k1 term has zero expected
  gradient — so use ``k3`` (GRPO) or ``k2``, not ``k1``, as a loss.
- **Reward penalty** (InstructGPT, arXiv 2203.02155): ``kl_reward_penalty(table, beta, kind)`` stores
  ``-beta * KL_t`` per trained token in ``StepTable.token_rewards``, computed from the behaviour
  policy's log-probs (``StepTable.behaviour_logprobs``) before the advantages. Where it lands for step-level data: ``gae_token``
  credits each token's penalty on that token; every step-level and trajectory-level estimator adds a
  step's summed penalty to that step's reward R_k (``step_table.step_rewards``). ``k1`` is the usual
  choice here (verl's and OpenRLHF's default).

Deviation: k3 clamps x to [-20, 20] before the exponential (as verl does) so that one extreme token
cannot overflow the sum.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import Tensor

from agent_r1.algos.registry import InvalidOption, Registry
from agent_r1.algos.step_table import StepTable

__all__ = [
    "KL_ESTIMATORS",
    "KLConfig",
    "get_kl_estimator",
    "kl_penalty",
    "kl_reward_penalty",
    "register_kl_estimator",
]

KLEstimator = Callable[[Tensor], Tensor]
"""``fn(log_ratio) -> per-token KL`` with log_ratio = log pi - log pi_ref."""

KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
register_kl_estimator = KL_ESTIMATORS.register


def get_kl_estimator(name: str) -> KLEstimator:
    return KL_ESTIMATORS.lookup(name)


@dataclass(frozen=True)
class KLConfig:
    """The KL regulariser to the reference policy (each field documented once, here); the
    ``algorithm.kl`` config section.

    coef: beta. Default 0: no KL and no reference model, as in DAPO (arXiv 2503.14476) and Dr. GRPO
        (arXiv 2503.20783), which drop it for verifiable rewards; GRPO used 0.04. > 0 loads a reference
        (with LoRA: the policy with its adapter disabled).
    estimator: the registered estimator (``KL_ESTIMATORS``). Default ``k3`` (GRPO's, for the loss
        term); ``k1`` is the usual choice for the reward penalty.
    penalty: "loss" adds ``coef`` x KL to the per-token loss (GRPO); "reward" subtracts ``coef`` x KL
        from each trained token's reward before the advantages (InstructGPT; ``kl_reward_penalty``).
    """

    coef: float = 0.0
    estimator: str = "k3"
    penalty: Literal["loss", "reward"] = "loss"

    def __post_init__(self) -> None:
        if self.coef < 0:
            raise InvalidOption("KLConfig", "coef", f"must be >= 0, got {self.coef}")
        if self.penalty not in ("loss", "reward"):
            raise InvalidOption("KLConfig", "penalty", f"must be 'loss' or 'reward', got {self.penalty!r}")


@register_kl_estimator("k1")
def k1(log_ratio: Tensor) -> Tensor:
    return log_ratio


@register_kl_estimator("k2")
def k2(log_ratio: Tensor) -> Tensor:
    return 0.5 * log_ratio.pow(2)


@register_kl_estimator("k3")
def k3(log_ratio: Tensor) -> Tensor:
    log_ratio = log_ratio.clamp(-20.0, 20.0)
    return torch.exp(-log_ratio) - 1.0 + log_ratio


def kl_penalty(
    logprobs: Tensor, ref_logprobs: Tensor, kind: str = "k3", *, mask: Tensor | None = None
) -> Tensor:
    """Per-token KL estimate of pi against the reference (same shape as the inputs).

    With ``mask``, tokens where it is 0 get exactly 0 and no gradient, whatever their log-probs hold.
    """
    for name, tensor in (("ref_logprobs", ref_logprobs), ("mask", mask)):
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"kl_penalty: {name} has shape {tuple(tensor.shape)}, logprobs have {tuple(logprobs.shape)}"
            )
    log_ratio = logprobs - ref_logprobs.detach()
    if mask is None:
        return get_kl_estimator(kind)(log_ratio)
    live = mask > 0
    kl = get_kl_estimator(kind)(torch.where(live, log_ratio, torch.zeros_like(log_ratio)))
    return torch.where(live, kl, torch.zeros_like(kl))


def kl_reward_penalty(table: StepTable, beta: float, kind: str = "k1") -> StepTable:
    """The table with ``-beta * KL_t`` (from ``behaviour_logprobs`` vs ``ref_logprobs``) added to ``token_rewards``
    on every trained token; see the module docstring for where estimators credit it."""
    if table.ref_logprobs is None:
        raise ValueError("kl_reward_penalty needs StepTable.ref_logprobs (the reference policy's log-probs)")
    penalty_NL = -beta * kl_penalty(
        table.behaviour_logprobs, table.ref_logprobs, kind, mask=table.response_mask
    )
    if table.token_rewards is not None:
        penalty_NL = table.token_rewards + penalty_NL
    return replace(table, token_rewards=penalty_NL)
