"""The HF engine's linear layers on the CPU through oneDNN, each weight packed once per version.

``F.linear`` on the CPU is MKL's sgemm, which re-reads the weight in its plain (out, in) layout at
every call. oneDNN's ``_linear_pointwise`` on a weight reordered once into its own blocked layout
(``_reorder_linear_weight``, what inductor's CPU weight prepacking uses) was faster at every row count
measured on this machine (2 threads, fp32; SmolLM2-135M's seven projection shapes over 30 layers,
each weight read from memory as in a forward): 5.6 -> 7.5 GFLOP/s at 1 row, 90 -> 134 at 32 (a
decode step), 157 -> 192 at 400, 165 -> 188 at 3,945 (a prefill forward). Whole rollouts: see
``benchmarks/HISTORY.md`` (issue 51).

``PackedLinears.active()`` is a torch function mode (per thread) entered around the engine's own
forwards only: inside it every ``F.linear`` without autograd on a CPU fp32 weight runs the packed
kernel; everything else (a learner's forward under autograd, another thread's forward on a shared
model) runs ``F.linear`` unchanged. A weight is packed the first time a forward meets it and again
whenever it was written since (its version counter moved, as ``update_weights`` or an optimizer step
on a shared model moves it, or its storage was replaced), so LoRA adapters and weight updates are
followed. The packed copies cost the linear weights' memory once more.

The results differ from ``F.linear``'s by float rounding (the kernels sum in another order: ~3e-6 on
SmolLM2's projections); the engine-vs-learner log-prob tests hold at their tolerance. A row's result
does not depend on the row count (measured for every count from 2 to 400, at one and two threads; a
single row of a 1,536-wide input rounds otherwise), which the batch-invariant engine checks for its
model's shapes before it relies on it (``batch_invariant.matmuls_invariant``).
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["PackedLinears", "available"]

log = logging.getLogger(__name__)


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def available() -> bool:
    """Whether this torch build runs oneDNN's packed linear (checked on a small product)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ones(4, 4)
        with torch.no_grad():
            out = _packed_linear(
                torch.ones(2, 4), torch.ops.mkldnn._reorder_linear_weight(weight, None), None
            )
    except (AttributeError, RuntimeError) as error:  # an op missing from this build, or refused
        log.info("oneDNN packed linear unavailable (%s); the engine runs F.linear", error)
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


class _Pack:
    __slots__ = ("data_ptr", "packed", "version", "weight")

    def __init__(self, weight: torch.Tensor, callback) -> None:
        self.weight = weakref.ref(weight, callback)
        self.data_ptr, self.version = weight.data_ptr(), weight._version
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)

    def current(self, weight: torch.Tensor) -> bool:
        return (
            self.weight() is weight and self.data_ptr == weight.data_ptr() and self.version == weight._version
        )


class PackedLinears:
    """The packed weights of one engine's model (``enabled`` False: ``active`` does nothing and
    ``linear`` is ``F.linear``). Not thread-safe: the engine's scheduler thread alone uses it."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._packs: dict[int, _Pack] = {}  # id(weight) -> its pack; dropped when the weight is freed

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` as the engine's forwards compute it."""
        pack = self._pack(x, weight) if self.enabled and not torch.is_grad_enabled() else None
        return F.linear(x, weight, bias) if pack is None else _packed_linear(x, pack, bias)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run this thread's ``F.linear`` calls through ``linear`` (when enabled)."""
        if not self.enabled:
            yield
            return
        with _Mode(self):
            yield

    def _pack(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """The packed copy of ``weight`` for a product with ``x``, or None where F.linear runs."""
        if (
            weight.device.type != "cpu"
            or weight.dtype != torch.float32
            or x.dtype != torch.float32
            or weight.dim() != 2
            or weight.layout != torch.strided
        ):
            return None
        key = id(weight)
        pack = self._packs.get(key)
        if pack is None or not pack.current(weight):
            packs = self._packs
            pack = self._packs[key] = _Pack(weight, lambda _, key=key: packs.pop(key, None))
        return pack.packed


class _Mode(TorchFunctionMode):
    def __init__(self, linears: PackedLinears) -> None:
        super().__init__()
        self.linears = linears

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            return self.linears.linear(*args, **kwargs)
        return func(*args, **kwargs)
