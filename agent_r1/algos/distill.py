"""On-policy distillation: a teacher's per-token signal on the student's own samples.

For every action token y_t the student sampled (``TokenFields.mask``: the model's own tokens of each
step, never tool or env tokens), the per-token reverse KL estimate is

    rkl_t = log pi_student(y_t | context) - log pi_teacher(y_t | context)

with the student's log-prob taken from the sampler (the policy that drew the token, i.e. the
trajectory step's own policy version), as in Thinking Machines' on-policy distillation recipe
(tinker-cookbook, 2025). Its negative is a per-token advantage: a policy gradient on
A_t = -rkl_t minimises the reverse KL KL(pi_student || pi_teacher) on the student's own
distribution (Gu et al. 2024, MiniLLM, arXiv 2306.08543; Agarwal et al. 2024, GKD, arXiv 2306.13649,
with lambda = 1, beta = 1). The term is not discounted: each token's advantage is its own KL
(tinker-cookbook's default ``kl_discount_factor = 0``).

Combination with the env reward (``distill_advantages``): the estimator's advantages (GRPO's group
normalisation, a critic's GAE, whitening: everything ``compute_advantages`` does) are computed from
the env's rewards alone; then

    A_t = reward_weight * A_estimator_t - coef * rkl_t

on the action tokens. The critic, if any, learns the env's returns only; the distillation term is
added after normalisation, so its scale is the KL's own (nats per token), not the group's.
"""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from agent_r1.algos.tokens import TokenFields

__all__ = ["distill_advantages", "distill_tokens", "reverse_kl_per_token"]


def reverse_kl_per_token(student_logprobs_T: Tensor, teacher_logprobs_T: Tensor, mask_T: Tensor) -> Tensor:
    """log p_student - log p_teacher of each sampled token (T,), zero where ``mask_T`` is zero."""
    return (student_logprobs_T - teacher_logprobs_T) * mask_T


def distill_advantages(
    advantages_T: Tensor,
    student_logprobs_T: Tensor,
    teacher_logprobs_T: Tensor,
    mask_T: Tensor,
    *,
    coef: float,
    reward_weight: float,
) -> tuple[Tensor, Tensor]:
    """``reward_weight * advantages_T - coef * rkl_T`` on the action tokens (zero elsewhere), and
    ``rkl_T`` itself; all (T,) in the batch's flat token order (see the module docstring)."""
    rkl_T = reverse_kl_per_token(student_logprobs_T, teacher_logprobs_T, mask_T)
    return (reward_weight * advantages_T - coef * rkl_T) * mask_T, rkl_T


def distill_tokens(
    tokens: TokenFields, teacher_logprobs_T: Tensor, *, coef: float, reward_weight: float
) -> tuple[TokenFields, dict[str, float]]:
    """A batch's per-token fields with the teacher's log-probs and the distilled advantages
    (``distill_advantages`` against the sampler's log-probs: each step's own policy version), and
    ``distill/reverse_kl``, the mean reverse KL per action token."""
    advantages_T, rkl_T = distill_advantages(
        tokens.advantages,
        tokens.sampler_logprobs,
        teacher_logprobs_T,
        tokens.mask,
        coef=coef,
        reward_weight=reward_weight,
    )
    reverse_kl = float(rkl_T.sum() / tokens.mask.sum().clamp(min=1))
    fields = replace(tokens, teacher_logprobs=teacher_logprobs_T, advantages=advantages_T)
    return fields, {"distill/reverse_kl": reverse_kl}
