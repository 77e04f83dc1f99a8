"""Loss aggregation: how per-token losses become one scalar, and what a "sequence" is.

Every mode is a set of per-token weights w_t (zero where the mask is zero), and the loss is
``sum_t w_t * loss_t``. Writing the modes as weights is what makes micro-batching exact: compute the
weights once over the whole mini-batch, split them with the tokens, and the micro-batch losses
``sum(w_mb * loss_mb)`` add up to the full-batch loss (see "Micro-batches" below).

| mode | loss | used by |
|---|---|---|
| ``token-mean`` | sum_t l_t / #tokens | DAPO (arXiv 2503.14476), verl default |
| ``seq-mean-token-sum`` | mean over sequences of sum_t l_t | |
| ``seq-mean-token-mean`` | mean over sequences of (mean over its tokens) | GRPO paper (arXiv 2402.03300), GSPO |
| ``seq-mean-token-sum-norm`` | sum_t l_t / (#sequences * norm_len) | Dr. GRPO (arXiv 2503.20783); norm_len = a constant, e.g. max response length |
| ``traj-mean-token-sum-norm`` | sum_t l_t / (#trajectories * norm_len) | Dr. GRPO's constant normaliser over trajectories: unbiased when the policy picks its number of turns |

**What a "sequence" is** for step-level data is decided by ``seq_ids`` (same shape as the loss, one
integer per token): pass the id of the *step* (the MDP action: one response) for step-level
semantics — the default meaning in agent-r1 — or the id of the *trajectory* to treat all responses
of an episode as one sequence (what concatenating frameworks do). A packed training row that holds
several prefix-merged steps is not a sequence: its tokens still carry their own step ids. Without
``seq_ids`` each row of the leading dimensions (all but the last) is one sequence.

**Equal trajectory weight.** With ``equal_trajectory_weight=True`` (needs ``traj_ids``) each
trajectory contributes equally however many steps or tokens it has: the mode is applied within each
trajectory, then trajectories are averaged. Otherwise a 10-step trajectory weighs ten times a 1-step
one under the ``seq-mean-*`` modes, and in proportion to its tokens under ``token-mean``.

Only tokens with mask > 0 count, sequences and trajectories without such tokens are not counted,
and an all-masked batch aggregates to 0 (never NaN).

**Micro-batches.** A mini-batch split into micro-batches (gradient accumulation) must use weights
computed over the whole mini-batch, else e.g. token-mean over unequal micro-batches is biased:

    weights_X = aggregation_weights(mask_X, mode, seq_ids=step_ids_X, ...)   # the flat mini-batch
    for mb in mbs:
        (weights_X[mb.index] * loss_fn(mb)).sum().backward()   # no division by the number of micro-batches

Ids must be unique across the whole mini-batch (e.g. step row / trajectory indices). Under data
parallelism whose all-reduce *averages* gradients over W ranks, compute the weights over the global
mini-batch (all ranks' masks and ids) and multiply each rank's loss by W.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from agent_r1.algos.registry import InvalidOption, Registry

__all__ = [
    "LOSS_AGGREGATIONS",
    "AggregationConfig",
    "TokenCounts",
    "aggregate",
    "aggregation_weights",
    "get_loss_aggregation",
    "register_aggregation",
]


@dataclass(frozen=True)
class TokenCounts:
    """Per-token counts (flattened, shape (X,)) that the aggregation modes are written in.

    A scope is one trajectory under ``equal_trajectory_weight``, else the whole batch.
    """

    tokens_in_seq: Tensor  # trained tokens of the token's sequence
    tokens_in_scope: Tensor  # trained tokens of the token's scope
    seqs_in_scope: Tensor  # sequences (with >= 1 trained token) of the token's scope
    trajs_in_scope: Tensor | None = None  # trajectories (with >= 1 trained token); None without traj_ids


AggregationMode = Callable[[Tensor, TokenCounts, "float | None"], Tensor]
"""``fn(mask_X, counts, norm_len) -> weights_X`` within one scope; each scope's weights are then
divided by the number of scopes."""

LOSS_AGGREGATIONS: Registry[AggregationMode] = Registry("loss aggregation")
register_aggregation = LOSS_AGGREGATIONS.register


def get_loss_aggregation(name: str) -> AggregationMode:
    return LOSS_AGGREGATIONS.lookup(name)


@dataclass(frozen=True)
class AggregationConfig:
    """How the trainer aggregates per-token losses (each field documented once, here); the
    ``algorithm.loss_aggregation`` config section (``loss_aggregation: token-mean`` is short for
    ``{name: token-mean}``). Sequences are steps (the trainer passes step ids).

    name: the registered mode (``LOSS_AGGREGATIONS``). Default ``token-mean`` (DAPO's token-level loss).
    equal_trajectory_weight: apply the mode within each trajectory, then average trajectories, so that
        every trajectory weighs the same however many steps or tokens it has. Default False.
    norm_len: the constant of ``seq-mean-token-sum-norm`` (Dr. GRPO) and ``traj-mean-token-sum-norm``.
        None (default) = the configured maximum response length (``rollout.max_tokens``).
    """

    name: str = "token-mean"
    equal_trajectory_weight: bool = False
    norm_len: float | None = None

    def __post_init__(self) -> None:
        if self.norm_len is not None and self.norm_len <= 0:
            raise InvalidOption(
                "AggregationConfig", "norm_len", f"must be > 0 (or null), got {self.norm_len}"
            )


@register_aggregation("token-mean")
def token_mean(mask: Tensor, counts: TokenCounts, norm_len: float | None) -> Tensor:
    return mask / counts.tokens_in_scope


@register_aggregation("seq-mean-token-sum")
def seq_mean_token_sum(mask: Tensor, counts: TokenCounts, norm_len: float | None) -> Tensor:
    return mask / counts.seqs_in_scope


@register_aggregation("seq-mean-token-mean")
def seq_mean_token_mean(mask: Tensor, counts: TokenCounts, norm_len: float | None) -> Tensor:
    return mask / (counts.seqs_in_scope * counts.tokens_in_seq)


@register_aggregation("traj-mean-token-sum-norm")
def traj_mean_token_sum_norm(mask: Tensor, counts: TokenCounts, norm_len: float | None) -> Tensor:
    """sum_t l_t / (#trajectories * norm_len): Dr. GRPO's constant normaliser with trajectories in
    place of responses. When the policy chooses how many turns it takes, the number of steps (and of
    tokens) in a batch is random and correlated with the advantages, so dividing by it biases the
    gradient; the number of trajectories is fixed by the batch size, so this mode is unbiased
    (docs/algorithms.md, "Stopping bias")."""
    if counts.trajs_in_scope is None:
        raise ValueError(
            "loss aggregation 'traj-mean-token-sum-norm' needs traj_ids (one trajectory id per token)"
        )
    return mask / (counts.trajs_in_scope * _norm_len("traj-mean-token-sum-norm", norm_len))


@register_aggregation("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(mask: Tensor, counts: TokenCounts, norm_len: float | None) -> Tensor:
    return mask / (counts.seqs_in_scope * _norm_len("seq-mean-token-sum-norm", norm_len))


def _norm_len(mode: str, norm_len: float | None) -> float:
    if norm_len is None or norm_len <= 0:
        raise ValueError(
            f"loss aggregation '{mode}' needs norm_len > 0 (e.g. the maximum response length), got {norm_len}"
        )
    return norm_len


def aggregation_weights(
    mask: Tensor,
    mode: str,
    *,
    seq_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
    norm_len: float | None = None,
    equal_trajectory_weight: bool = False,
) -> Tensor:
    """Per-token weights (shape of ``mask``) such that the aggregated loss is ``(weights * loss).sum()``."""
    fn = get_loss_aggregation(mode)
    if seq_ids is None:
        seq_ids = torch.arange(mask[..., 0].numel(), device=mask.device).reshape(mask.shape[:-1])[..., None]
        seq_ids = seq_ids.expand(mask.shape)
    _check_shape("seq_ids", seq_ids, mask)
    if equal_trajectory_weight:
        if traj_ids is None:
            raise ValueError("equal_trajectory_weight=True needs traj_ids (one trajectory id per token)")
        _check_shape("traj_ids", traj_ids, mask)
        scope_ids = traj_ids
    else:
        scope_ids = torch.zeros_like(seq_ids)
    mask_X = (mask.reshape(-1) > 0).to(torch.float32)
    if not mask_X.any():
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    seq_X = torch.unique(seq_ids.reshape(-1), return_inverse=True)[1]
    scope_X = torch.unique(scope_ids.reshape(-1), return_inverse=True)[1]
    tokens_per_seq = _sum_by(mask_X, seq_X)
    tokens_per_scope = _sum_by(mask_X, scope_X)
    live = mask_X > 0
    seq_scope = torch.full_like(tokens_per_seq, -1, dtype=torch.long)
    seq_scope[seq_X[live]] = scope_X[live]
    if (seq_scope[seq_X[live]] != scope_X[live]).any():
        raise ValueError("loss aggregation: a sequence id spans several trajectories (seq_ids vs traj_ids)")
    has_tokens = tokens_per_seq > 0
    seqs_per_scope = _sum_by(
        has_tokens.to(torch.float32)[has_tokens], seq_scope[has_tokens], tokens_per_scope.numel()
    )
    trajs_in_scope = None
    if traj_ids is not None:
        _check_shape("traj_ids", traj_ids, mask)
        traj_X = torch.unique(traj_ids.reshape(-1), return_inverse=True)[1]
        traj_live = _sum_by(mask_X, traj_X) > 0
        traj_scope = torch.zeros_like(traj_live, dtype=torch.long)
        traj_scope[traj_X[live]] = scope_X[live]  # a trajectory lies in one scope (itself, or the batch)
        trajs_per_scope = _sum_by(
            traj_live.to(torch.float32)[traj_live], traj_scope[traj_live], tokens_per_scope.numel()
        )
        trajs_in_scope = trajs_per_scope[scope_X].clamp(min=1)
    counts = TokenCounts(
        tokens_in_seq=tokens_per_seq[seq_X].clamp(min=1),
        tokens_in_scope=tokens_per_scope[scope_X].clamp(min=1),
        seqs_in_scope=seqs_per_scope[scope_X].clamp(min=1),
        trajs_in_scope=trajs_in_scope,
    )
    num_scopes = int((tokens_per_scope > 0).sum())
    weights_X = fn(mask_X, counts, norm_len) * mask_X / num_scopes
    return weights_X.reshape(mask.shape)


def aggregate(
    loss_per_token: Tensor,
    mask: Tensor,
    mode: str,
    *,
    seq_ids: Tensor | None = None,
    traj_ids: Tensor | None = None,
    norm_len: float | None = None,
    equal_trajectory_weight: bool = False,
) -> Tensor:
    """The scalar loss: ``sum(weights * loss_per_token)``; masked tokens contribute nothing (not even NaN)."""
    _check_shape("loss_per_token", loss_per_token, mask)
    weights = aggregation_weights(
        mask,
        mode,
        seq_ids=seq_ids,
        traj_ids=traj_ids,
        norm_len=norm_len,
        equal_trajectory_weight=equal_trajectory_weight,
    ).to(loss_per_token.dtype)
    return torch.where(weights != 0, loss_per_token * weights, torch.zeros_like(loss_per_token)).sum()


def _sum_by(values: Tensor, ids: Tensor, size: int | None = None) -> Tensor:
    size = int(ids.max()) + 1 if size is None else size
    return torch.zeros(size, dtype=values.dtype, device=values.device).index_add_(0, ids, values)


def _check_shape(name: str, tensor: Tensor, mask: Tensor) -> None:
    if tensor.shape != mask.shape:
        raise ValueError(
            f"loss aggregation: {name} has shape {tuple(tensor.shape)}, mask has {tuple(mask.shape)}"
        )
