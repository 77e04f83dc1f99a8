"""Comparing a data-parallel run's updates with the single-process run's, soundly under float32 rounding.

Two runs that do the same arithmetic in a different order (micro-batches summed on two ranks and
all-reduced, other CPU kernels) see gradients that differ by rounding. Comparing their weights after a
few AdamW steps with a flat tolerance is unsound: AdamW divides by the gradient's running RMS, so in an
entry whose gradient is rounding-sized the difference becomes a step of up to ~lr, whatever its size.
What holds on every machine:

1. The gradients of the first optimizer step (both runs at the initial weights) match to rounding;
   later steps start from weights that already differ by (1), so their gradients match less tightly.
2. The weights differ by at most what AdamW makes of the *measured* gradient differences
   (``adam_difference_bound``): tight where the gradient is large against its difference, up to
   ~2 lr a step where it is not.

``record_optimizer_steps`` logs, at every optimizer step of a ``Learner``, the gradients it applied
(after clipping), its hyperparameters and the parameters it left; ``record_worker_optimizer_steps``
does it inside the Ray learner workers (every rank applies the same all-reduced gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import torch

FLOAT32_EPS = torch.finfo(torch.float32).eps  # 2 x the unit roundoff

# Per-tensor ||g_ours - g_theirs|| / ||g_theirs||. First step: the same weights and data, summed in
# another order; a reordered float32 sum of n terms moves by ~sqrt(n) unit roundoffs of its terms'
# scale, and backward through 4 layers over a few hundred tokens stays within ~1e-5 (measured: 9e-7).
# Later steps: the inputs also differ by the weights' AdamW-amplified rounding (measured: 5e-5).
# A wrong loss, advantage or mini-batch changes a gradient by O(1).
FIRST_STEP_GRAD_RTOL = 3e-5
LATER_STEP_GRAD_RTOL = 1e-3


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on CPU (an FSDP2 shard is gathered: a collective, so every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().cpu().clone()


def record_optimizer_steps(learner, model, sink: Callable[[dict], None] | None = None) -> list[dict]:
    """After every optimizer step of ``learner``: its hyperparameters, the gradients it applied (after
    clipping) and the trainable parameters it left, named as in ``model``. Returns the list the
    records are appended to (or passes each to ``sink``). On data-parallel ranks call it on every
    rank (FSDP2 shards are gathered)."""
    names = {id(p): name for name, p in model.named_parameters()}
    params = [(names[id(p)], p) for p in learner.trainable_parameters]
    log: list[dict] = []
    sink = sink or log.append

    def record(optimizer, args, kwargs):
        group = optimizer.param_groups[0]
        entry = {key: group[key] for key in ("lr", "betas", "eps", "weight_decay", "amsgrad")}
        entry["grads"] = {name: _full(p.grad) for name, p in params}
        entry["params"] = {name: _full(p) for name, p in params}
        sink(entry)

    learner.optimizer.register_step_post_hook(record)
    return log


def record_worker_optimizer_steps(worker, directory: str) -> None:
    """``record_optimizer_steps`` on a Ray ``LearnerWorker`` (through ``actor.__ray_call__``, on every
    worker): rank 0 saves step k as ``directory/step_{k}.pt``."""
    count = [0]

    def save(entry: dict) -> None:
        count[0] += 1
        if worker.rank == 0:
            torch.save(entry, Path(directory) / f"step_{count[0]:03d}.pt")

    record_optimizer_steps(worker.learner, worker.learner.model, save)


def load_optimizer_steps(directory: Path) -> list[dict]:
    return [torch.load(f) for f in sorted(Path(directory).glob("step_*.pt"))]


def assert_gradients_match(ours: list[dict], theirs: list[dict]) -> None:
    assert len(ours) == len(theirs) > 0
    for k, (mine, single) in enumerate(zip(ours, theirs, strict=True)):
        assert mine["grads"].keys() == single["grads"].keys()
        rtol = FIRST_STEP_GRAD_RTOL if k == 0 else LATER_STEP_GRAD_RTOL
        for name, g in single["grads"].items():
            diff, scale = float((mine["grads"][name] - g).norm()), float(g.norm())
            assert diff <= rtol * scale, f"optimizer step {k + 1}, {name}: |diff| {diff:.3e}, |g| {scale:.3e}"


def adam_difference_bound(
    ours: list[dict], theirs: list[dict], weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Per weight, the most by which AdamW with ``theirs``' hyperparameters, started from the same
    weights, can end apart when one run applies ``ours``' gradients and the other ``theirs``'
    (``weights``: one run's final weights, for the rounding term).

    torch.optim.AdamW at step t: w_t = (1 - lr_t wd) w_{t-1} - lr_t u_t with u_t = m_t / (s_t + eps),
    m_t = sum_j a_tj g_j and s_t = sqrt(sum_j b_tj g_j^2) over steps j <= t, where
    a_tj = (1 - b1) b1^(t-j) / (1 - b1^t) and b_tj = (1 - b2) b2^(t-j) / (1 - b2^t) (bias-corrected).
    With d_j = |g_j - g'_j| elementwise:
      |m_t - m'_t| <= sum_j a_tj d_j = dm_t;
      |s_t - s'_t| <= sqrt(sum_j b_tj d_j^2) = ds_t   (s is a weighted 2-norm of the history);
      |u'_t| <= U_t = sqrt(sum_j a_tj^2 / b_tj)        (Cauchy-Schwarz, for any history);
      u_t - u'_t = (m_t - m'_t) / (s_t + eps) + u'_t (s'_t - s_t) / (s_t + eps), so
      |u_t - u'_t| <= min(2 U_t, (dm_t + U_t ds_t) / (s_t + eps));
      |w_T - w'_T| <= sum_t lr_t |u_t - u'_t|          (0 <= lr wd <= 1 only shrinks differences).
    Added: both runs' own float32 AdamW rounding, per step an eps (2 unit roundoffs) of |w_t| <=
    |w_T| + sum_t lr_t U_t, and 8 eps of the step lr_t U_t (the few operations that compute u_t).
    """
    assert len(ours) == len(theirs) > 0
    first = theirs[0]
    assert not first["amsgrad"] and all(
        s[key] == first[key] for s in theirs for key in ("betas", "eps", "weight_decay")
    )
    (b1, b2), eps = first["betas"], first["eps"]
    steps = len(theirs)
    bounds = {}
    for name in first["grads"]:
        g_TX = torch.stack([s["grads"][name].double() for s in theirs])  # (T, *shape)
        d_TX = (torch.stack([s["grads"][name].double() for s in ours]) - g_TX).abs()
        bound_X = torch.zeros_like(g_TX[0])
        travel = 0.0  # sum_t lr_t U_t: the most either run moves a weight
        for t in range(1, steps + 1):
            j = torch.arange(1, t + 1, dtype=torch.float64).view(-1, *[1] * (g_TX.dim() - 1))
            a = (1 - b1) * b1 ** (t - j) / (1 - b1**t)
            b = (1 - b2) * b2 ** (t - j) / (1 - b2**t)
            u_max = math.sqrt(float((a**2 / b).sum()))
            s = torch.sqrt((b * g_TX[:t] ** 2).sum(0))
            dm, ds = (a * d_TX[:t]).sum(0), torch.sqrt((b * d_TX[:t] ** 2).sum(0))
            lr = theirs[t - 1]["lr"]
            bound_X += lr * torch.clamp((dm + u_max * ds) / (s + eps), max=2 * u_max)
            travel += lr * u_max
        w_X = weights[name].double().abs()
        bounds[name] = bound_X + FLOAT32_EPS * (steps * (w_X + travel) + 8 * travel)
    return bounds


def lora_merged_bound(
    bounds: dict[str, torch.Tensor], adapters: dict[str, torch.Tensor], scale: float, merged: dict
) -> dict[str, torch.Tensor]:
    """Bounds on the merged weights W + scale B A (``export_weights``) from the adapters' bounds
    (``adapters``: one run's lora_A / lora_B, peft names; ``merged``: its merged weights):
    B'A' - BA = dB A + B dA + dB dA, so |B'A' - BA| <= |dB| |A| + |B| |dA| + |dB| |dA| (matrix
    products of elementwise bounds); plus both runs' float32 rounding of the product (rank + 1 eps of
    scale |B| |A|) and of the sum (an eps of |W|)."""
    out = {}
    for name, a in adapters.items():
        if ".lora_A." not in name:
            continue
        b_name = name.replace(".lora_A.", ".lora_B.")
        abs_A, abs_B = a.double().abs(), adapters[b_name].double().abs()
        d_A, d_B = bounds[name], bounds[b_name]
        weight = name.split(".lora_A.")[0].removeprefix("base_model.model.") + ".weight"
        product = abs_B @ abs_A
        out[weight] = scale * (
            d_B @ abs_A + abs_B @ d_A + d_B @ d_A + (a.shape[0] + 1) * FLOAT32_EPS * product
        )
        out[weight] += FLOAT32_EPS * merged[weight].double().abs()
    return out
