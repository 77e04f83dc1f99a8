"""The HF engine's large linear layers on the CPU through oneDNN, each weight packed once per version.

``F.linear`` on the CPU is MKL's sgemm, which reads the weight in its plain (out, in) layout at every
call. oneDNN's ``_linear_pointwise`` on a weight reordered once into its own blocked layout
(``_reorder_linear_weight``, what inductor's CPU weight prepacking uses) was faster on this machine
(2 threads, fp32) for SmolLM2-135M's projections at every row count from 1 to 3,945, each weight read
from memory as in a forward: 5.6 -> 7.5 GFLOP/s at 1 row, 90 -> 134 at 32 (a decode step), 157 -> 192
at 400, 165 -> 188 at 3,945 (a prefill forward); its 49,152 x 576 LM head at 32 rows took 10.7 ms
against 27.4. A oneDNN call costs ~15 us more than MKL's, so small weights lose (the quickstart's
tiny model, every weight at most 384 x 128, decoded ~15% slower): only weights of at least
``MIN_ELEMENTS`` are packed, and a model with none runs exactly as before.

``PackedLinears(model)`` finds those layers (plain ``nn.Linear`` modules whose ``forward`` is not
already replaced, e.g. by accelerate's hooks); ``active()``, entered around the engine's own forwards,
gives each of them a ``forward`` of its own for the duration (an instance attribute, removed on exit),
which runs the packed kernel for the calling thread without autograd and ``F.linear`` otherwise (a
forward under autograd, or another thread's, is unchanged). A weight is packed the first time a
forward meets it and again whenever it was written since (its version counter moved, as
``update_weights`` or an optimizer step on a shared model moves it, or its storage was replaced).
The packed copies cost those weights' memory once more.

The results differ from ``F.linear``'s by float rounding (the kernels sum in another order: ~3e-6 on
SmolLM2's projections); the engine-vs-learner log-prob tests hold at their tolerance. A row's result
does not depend on the row count (measured for every count from 2 to 400, at one and two threads; a
single row of a 1,536-wide input rounds otherwise), which the batch-invariant engine checks for its
model's shapes before it relies on it (``batch_invariant.matmuls_invariant``).

**A narrower compute type** (``PackedLinears(model, dtype=torch.bfloat16)``, the engine's
``compute_dtype``): each packed weight is a bf16 copy (or fp16), packed once per version as above, and
a packed layer rounds its input to that type, multiplies in it (oneDNN's avx512_bf16 / AMX kernels,
fp32 accumulation) and returns fp32. Everything between the linears (norms, rotary embeddings, the
residual stream, the softmax and sampling) stays fp32, as do the parameters themselves (the
learner's, when the engine shares its model): only the products the hardware speeds up narrow. (The
engine's KV cache and attention narrow with it, ``HFEngine(narrow_attention=True)``: that is the
engine's, not this module's.)
The LM head stays fp32 unless ``narrow_head``: oneDNN writes a bf16 product in bf16, so its logits
would carry bf16's rounding (~0.03 on a logit of 10) straight into the sampled distribution. On a GPU
nothing is packed; ``active`` runs the forwards under ``torch.autocast`` in the narrower type.
The log-probs then differ from an fp32 learner's by bf16's rounding of the weights and inputs (unit
roundoff 2^-9), which ``agent_r1.algos.off_policy`` corrects and the step reports as ``mismatch/*``.
The small weights that are not packed run ``F.linear`` in fp32, unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
import weakref
from collections.abc import Iterator

import torch
import torch.nn.functional as F

__all__ = ["MIN_ELEMENTS", "NARROW_TYPES", "PackedLinears", "available", "narrow_type_available"]

log = logging.getLogger(__name__)

MIN_ELEMENTS = 2**18
"""The smallest weight (out x in elements, 1 MiB in fp32) that is packed: below it MKL's lower call
overhead won (``benchmarks/HISTORY.md``, issue 51)."""


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def available() -> bool:
    """Whether this torch build runs oneDNN's packed linear (checked on a small product)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4), None)
            out = _packed_linear(torch.ones(2, 4), packed, None)
    except (AttributeError, RuntimeError) as error:  # an op missing from this build, or refused
        log.info("oneDNN packed linear unavailable (%s); the engine runs F.linear", error)
        return False
    return bool(torch.equal(out, torch.full((2, 4), 4.0)))


NARROW_TYPES = (torch.bfloat16, torch.float16)
"""The compute types a packed layer may narrow to (besides fp32)."""


def narrow_type_available(dtype: torch.dtype) -> bool:
    """Whether this torch build runs oneDNN's packed linear in ``dtype`` on this CPU (checked on a
    small product: oneDNN refuses a type the CPU has no kernel for)."""
    if dtype == torch.float32:
        return available()
    if not available():
        return False
    try:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(4, 4, dtype=dtype), None)
            out = _packed_linear(torch.ones(2, 4, dtype=dtype), packed, None)
    except (AttributeError, RuntimeError) as error:
        log.info("oneDNN packed linear in %s unavailable (%s)", dtype, error)
        return False
    return bool(torch.equal(out.float(), torch.full((2, 4), 4.0)))


def packable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is one this module packs: a 2D fp32 CPU tensor of at least ``MIN_ELEMENTS``."""
    return (
        weight.device.type == "cpu"
        and weight.dtype == torch.float32
        and weight.dim() == 2
        and weight.layout == torch.strided
        and weight.numel() >= MIN_ELEMENTS
    )


class _Pack:
    __slots__ = ("data_ptr", "dtype", "packed", "version", "weight")

    def __init__(self, weight: torch.Tensor, callback, dtype: torch.dtype) -> None:
        self.weight = weakref.ref(weight, callback)
        self.data_ptr, self.version, self.dtype = weight.data_ptr(), weight._version, dtype
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().to(dtype), None)

    def current(self, weight: torch.Tensor, dtype: torch.dtype) -> bool:
        return (
            self.weight() is weight
            and self.data_ptr == weight.data_ptr()
            and self.version == weight._version
            and self.dtype == dtype
        )


class PackedLinears:
    """The packed weights of ``model``'s large linear layers (None: no layers, ``linear`` alone;
    ``enabled`` False: ``active`` does nothing and ``linear`` is ``F.linear``). ``dtype``: the packed
    layers' compute type, fp32 or one of ``NARROW_TYPES`` (the input rounded to it, the result fp32).
    Not thread-safe: one thread (the engine's scheduler) enters ``active`` at a time."""

    def __init__(
        self,
        model: torch.nn.Module | None,
        enabled: bool = True,
        dtype: torch.dtype = torch.float32,
        narrow_head: bool = False,
    ) -> None:
        if dtype != torch.float32 and dtype not in NARROW_TYPES:
            raise ValueError(f"PackedLinears: dtype must be float32, bfloat16 or float16, got {dtype}")
        self.enabled = enabled
        self.dtype = dtype
        head = _output_head(model)
        # the LM head stays fp32 unless narrow_head: its rounded logits would be the sampler's
        self._head_dtype = dtype if narrow_head else torch.float32
        # on a GPU nothing is packed: the narrower type is autocast's around the engine's forwards
        device = None if model is None else next(model.parameters(), torch.empty(0)).device
        self._autocast = device is not None and device.type != "cpu" and dtype != torch.float32
        self._device_type = None if device is None else device.type
        modules = [] if model is None or not enabled else model.modules()
        # each layer with the forward ``active`` gives it, made once
        self._forwards = [
            (m, types.MethodType(self._head_forward if m is head else self._forward, m))
            for m in modules
            if type(m).forward is torch.nn.Linear.forward
            and "forward" not in m.__dict__
            and packable(m.weight)
        ]
        self._packs: dict[int, _Pack] = {}  # id(weight) -> its pack; dropped when the weight is freed
        self._thread: int | None = None

    @property
    def layers(self) -> int:
        """How many linear layers run packed."""
        return len(self._forwards)

    def linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """``F.linear(x, weight, bias)`` as the engine's forwards compute it: packed for a packable
        weight without autograd, in ``dtype`` (default: this instance's), the result in ``x``'s type."""
        if not self.enabled or torch.is_grad_enabled() or x.dtype != torch.float32 or not packable(weight):
            return F.linear(x, weight, bias)
        dtype = self.dtype if dtype is None else dtype
        key = id(weight)
        pack = self._packs.get(key)
        if pack is None or not pack.current(weight, dtype):
            packs = self._packs
            pack = packs[key] = _Pack(weight, lambda _, key=key: packs.pop(key, None), dtype)
        if dtype == torch.float32:
            return _packed_linear(x, pack.packed, bias)
        bias = None if bias is None else bias.to(dtype)
        return _packed_linear(x.to(dtype), pack.packed, bias).to(x.dtype)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run the packed layers through ``linear`` for this thread until exit (on a GPU, in a
        narrower type: the forwards under autocast)."""
        if self._autocast:
            with torch.autocast(self._device_type, dtype=self.dtype):
                yield
            return
        if not self._forwards:
            yield
            return
        self._thread = threading.get_ident()
        for module, forward in self._forwards:
            module.__dict__["forward"] = forward
        try:
            yield
        finally:
            for module, _ in self._forwards:
                module.__dict__.pop("forward", None)
            self._thread = None

    def _forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != self._thread:
            return F.linear(x, module.weight, module.bias)
        return self.linear(x, module.weight, module.bias)

    def _head_forward(self, module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
        if threading.get_ident() != self._thread:
            return F.linear(x, module.weight, module.bias)
        return self.linear(x, module.weight, module.bias, self._head_dtype)


def _output_head(model: torch.nn.Module | None) -> torch.nn.Module | None:
    """The model's output embedding (its LM head), or None."""
    get = getattr(model, "get_output_embeddings", None)
    try:
        return get() if callable(get) else None
    except (AttributeError, NotImplementedError):
        return None
