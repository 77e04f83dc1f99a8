"""Value (critic) loss, per token: PPO's clipped value loss.

    v_clip = v_old + clip(v - v_old, -clip, +clip)
    l_t = 1/2 * max((v - R)^2, (v_clip - R)^2)

(Schulman et al. 2017, arXiv 1707.06347, as implemented in OpenAI baselines' ppo2; R are the
``returns`` of a GAE estimator.) ``clip=None`` gives the plain squared error. The default 0.2 is
ppo2's (it reuses the policy clip range); verl defaults to 0.5. Aggregate the result with
``agent_r1.algos.aggregation`` like the policy loss. Token-level critics (``gae_token``) predict per
token; a step-level critic (``gae_step``) predicts one value per step, so pass (N,) tensors and an
all-ones mask.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["clipped_value_loss"]


def clipped_value_loss(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None = 0.2
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss_per_token, metrics): the loss is 0 where ``mask`` is 0 and no gradient reaches those tokens."""
    for name, tensor in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if tensor.shape != values.shape:
            raise ValueError(
                f"value loss: {name} has shape {tuple(tensor.shape)}, values have {tuple(values.shape)}"
            )
    if clip is not None and clip <= 0:
        raise ValueError(f"value loss: clip must be > 0 (or None), got {clip}")
    live = mask > 0
    zero = torch.zeros_like(values)
    values = torch.where(live, values, zero)
    old_values = torch.where(live, old_values.detach(), zero)
    returns = torch.where(live, returns.detach(), zero)
    unclipped = (values - returns).pow(2)
    if clip is None:
        loss = 0.5 * unclipped
        clipped_more = torch.zeros_like(live)
    else:
        clipped_values = old_values + torch.clamp(values - old_values, -clip, clip)
        clipped = (clipped_values - returns).pow(2)
        loss = 0.5 * torch.maximum(unclipped, clipped)
        clipped_more = clipped > unclipped
    live_f = live.to(values.dtype)
    count = live_f.sum().clamp(min=1)
    metrics = {
        "value_clip_fraction": (clipped_more.to(values.dtype) * live_f).sum() / count,
        "value_mean": (values * live_f).sum() / count,
        "value_error": ((values - returns).abs() * live_f).sum() / count,
    }
    return torch.where(live, loss, zero), {name: value.detach() for name, value in metrics.items()}
