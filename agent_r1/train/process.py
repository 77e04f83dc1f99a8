"""Process-wide settings a training process applies once: torch's thread count and the C allocator.

Why the allocator: on the CPU a training step frees and allocates the same large tensors over and
over (a 16k-token micro-batch's MLP activations are 25 MB each, per layer, forward and backward).
glibc serves a large allocation with a fresh ``mmap`` and returns it to the kernel when it is freed
(the threshold starts at 128 KiB and follows the largest block freed, up to 32 MiB), and it trims the
top of its heap once more than twice that threshold is free there; every reuse then pays a page fault
per 4 KiB page on first touch. Measured on the quickstart race's iteration (``benchmarks/vs_trl_multiturn.py``'s
agent-r1 side, one thread): 204k page faults per update, and an elementwise multiply over one such
tensor ran 10x slower per element than over a tensor a third its size. Keeping freed memory in the
process (allocations up to 32 MiB from the heap, no trimming, the heap grown in 256 MiB steps, one
arena) is what PyTorch's CPU performance guide gets from jemalloc / tcmalloc, here without preloading
a library. The cost: the resident set stays at its peak instead of shrinking between phases.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform

import torch

from agent_r1.train.config import TrainerConfig

__all__ = ["apply_process_settings", "retain_freed_memory"]

log = logging.getLogger(__name__)

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -2, -3, -8
_MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's largest accepted value (HEAP_MAX_SIZE / 2 on 64-bit)
_TOP_PAD = 256 * 1024 * 1024
_TRIM_THRESHOLD = 2**31 - 1  # the largest int: freed memory at the heap's top is never given back


def retain_freed_memory() -> bool:
    """Keep freed memory in this process (see the module docstring); True when glibc took the
    settings, False (with a warning) where the C library is not glibc."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        log.warning(
            "trainer.retain_freed_memory: the C library is not glibc (%s %s); the allocator is left as it is",
            platform.system(),
            platform.libc_ver()[0] or "unknown libc",
        )
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    settings = {
        "M_MMAP_THRESHOLD": (_M_MMAP_THRESHOLD, _MMAP_THRESHOLD),
        "M_TRIM_THRESHOLD": (_M_TRIM_THRESHOLD, _TRIM_THRESHOLD),
        "M_TOP_PAD": (_M_TOP_PAD, _TOP_PAD),
        "M_ARENA_MAX": (_M_ARENA_MAX, 1),
    }
    refused = [name for name, (param, value) in settings.items() if libc.mallopt(param, value) != 1]
    if refused:
        log.warning("trainer.retain_freed_memory: glibc refused %s", ", ".join(refused))
    return not refused


def apply_process_settings(trainer: TrainerConfig) -> None:
    """``trainer.torch_threads`` and ``trainer.retain_freed_memory``, in the process that trains or
    samples (the trainer's own, a Ray learner worker's or rollout actor's)."""
    if trainer.torch_threads:
        torch.set_num_threads(trainer.torch_threads)
    if trainer.retain_freed_memory:
        retain_freed_memory()
