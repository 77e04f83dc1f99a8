"""This machine's limits, measured in the calling run at its torch thread count (imported by the
benchmark scripts beside it, which compare what they achieve against these).

- ``mm_peak``: the fp32 matrix-multiply peak, ``torch.mm`` of two square matrices (2 x size^3 FLOPs).
- ``packed_peak``: the same product through oneDNN on a packed weight (``_linear_pointwise``, what
  the HF engine's linears run on the CPU: ``agent_r1.rollout.packed_linear``), or None without it.
- ``matmul_rate``: the FLOP/s of one given shape, e.g. a decode step's (batch, hidden) x
  (hidden, intermediate), which is far from square.
- ``memory_bandwidth``: bytes per second read by ``torch.sum`` of a large fp32 tensor and moved by a
  copy of it (read + write), for tensors far larger than any cache.

Each is the median of ``repeats`` timings after one warm-up run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timed(fn: Callable[[], object], repeats: int) -> float:
    """The median seconds of ``fn()`` over ``repeats`` runs, after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def mm_peak(size: int, repeats: int) -> float:
    """FLOP/s of ``torch.mm`` of two (size, size) fp32 matrices: 2 x size^3 per product."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    return 2 * size**3 / timed(lambda: torch.mm(a, b), repeats)


def packed_peak(size: int, repeats: int) -> float | None:
    """FLOP/s of the (size, size) fp32 product as oneDNN's linear on a weight packed once; None where
    this torch build lacks it."""
    from agent_r1.rollout import packed_linear

    if not packed_linear.available():
        return None
    a, b = torch.randn(size, size), torch.randn(size, size)
    linears = packed_linear.PackedLinears(None)
    with torch.no_grad():
        return 2 * size**3 / timed(lambda: linears.linear(a, b), repeats)


def matmul_rate(rows: int, inner: int, cols: int, repeats: int) -> float:
    """FLOP/s of ``torch.mm`` of fp32 (rows, inner) x (inner, cols): 2 x rows x inner x cols per
    product, run enough times per timing (~0.1 GFLOP) that a small shape is not timer noise."""
    a, b = torch.randn(rows, inner), torch.randn(inner, cols)
    flops = 2 * rows * inner * cols
    loops = max(1, int(1e8 // flops))

    def run() -> None:
        for _ in range(loops):
            torch.mm(a, b)

    return loops * flops / timed(run, repeats)


def memory_bandwidth(mib: int, repeats: int) -> tuple[float, float]:
    """(read, copy) bytes/s on a ``mib`` MiB fp32 tensor: ``torch.sum`` reads it once; a copy into a
    second tensor reads and writes it (2 x its bytes)."""
    src = torch.ones(mib * (1 << 20) // 4)
    dst = torch.empty_like(src)
    size = src.numel() * 4
    read = size / timed(lambda: src.sum(), repeats)
    copy = 2 * size / timed(lambda: dst.copy_(src), repeats)
    return read, copy
