"""Entropy of the policy's next-token distribution, for logging and for an entropy bonus.

    H = -sum_v p_v log p_v = logsumexp(z) - sum_v softmax(z)_v z_v

Bonus: ``loss = pg_loss - entropy_coef * aggregate(entropy_from_logits(logits), mask, mode)``
(Mnih et al. 2016, arXiv 1602.01783; PPO uses it too). LLM RL usually keeps entropy_coef = 0 and
only logs the entropy; with temperature sampling pass ``logits / temperature``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["entropy_from_logits"]


def entropy_from_logits(logits: Tensor) -> Tensor:
    """(..., V) logits -> (...,) entropy in nats."""
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(-1)
