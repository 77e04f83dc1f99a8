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

``trainer.deterministic`` (``deterministic_settings``): the process-wide half of the deterministic mode
(the engine's half is ``agent_r1.train.builders.rollout_engine``'s). torch's CPU wheel does its float32
matrix products (``nn.Linear``, ``addmm``, ``bmm``) in MKL's ``sgemm``, which picks its kernel by CPU
and by the alignment of its operands; the alignment of a fresh buffer differs between processes, so
two processes can round the same product differently in the last bit. MKL's conditional numerical
reproducibility (``MKL_CBWR``, read once, when MKL first runs) fixes the code path. The default, AUTO,
fixes the path MKL picks for this CPU (run to run on the same machine, what the mode promises);
COMPATIBLE, the path every x86 CPU can run (the same bits on other CPUs too), ran a float32 sgemm
4x slower here at one thread (36 against 146 GFLOP/s, 2048x576x1536). It is set here
through MKL's own ``mkl_cbwr_set`` (exported by ``libtorch_cpu``), which refuses once MKL has run: that
is then an error telling to set ``MKL_CBWR`` in the environment. ``tests/test_deterministic.py``
shows that without it two processes differ and with it they agree to the bit.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
from pathlib import Path

import torch

from agent_r1.train.config import TrainerConfig

__all__ = ["apply_process_settings", "deterministic_settings", "retain_freed_memory", "set_torch_threads"]

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


# MKL's branch codes (mkl_cbwr.h).
_MKL_CBWR_ALL, _MKL_CBWR_BRANCH_OFF = -1, 1
_MKL_CBWR_BRANCHES = {"AUTO": 2, "COMPATIBLE": 3, "SSE2": 4, "SSE4_2": 8, "AVX": 9, "AVX2": 10, "AVX512": 14}
_MKL_CBWR_STRICT = 0x10000
DEFAULT_MKL_CBWR = "AUTO"  # CNR on this CPU's own kernels: COMPATIBLE's ran sgemm 4x slower


def _mkl_cbwr_code(value: str) -> int:
    """``MKL_CBWR``'s value (``BRANCH[,STRICT]``) as MKL's code."""
    branch, _, strict = value.upper().partition(",")
    if branch.strip() not in _MKL_CBWR_BRANCHES or strict.strip() not in ("", "STRICT"):
        raise ValueError(
            f"MKL_CBWR={value!r}: expected one of {sorted(_MKL_CBWR_BRANCHES)}, optionally ',STRICT'"
        )
    return _MKL_CBWR_BRANCHES[branch.strip()] | (_MKL_CBWR_STRICT if strict.strip() else 0)


def _torch_mkl():
    """libtorch_cpu, where MKL is linked in, or None (a torch built without MKL)."""
    if not torch.backends.mkl.is_available():
        return None
    library = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    if not library.is_file():
        return None
    lib = ctypes.CDLL(str(library))
    if not hasattr(lib, "mkl_serv_cbwr_set"):
        return None
    lib.mkl_serv_cbwr_get.argtypes = lib.mkl_serv_cbwr_set.argtypes = [ctypes.c_int]
    lib.mkl_serv_cbwr_get.restype = lib.mkl_serv_cbwr_set.restype = ctypes.c_int
    return lib


def deterministic_settings() -> None:
    """Reproducible kernels in this process (``trainer.deterministic``): MKL's reproducible mode
    (``MKL_CBWR``, AUTO unless the environment names another), ``torch.use_deterministic_algorithms``
    and, on CUDA, cuBLAS's fixed workspace without cuDNN benchmarking. ``MKL_CBWR`` and
    ``CUBLAS_WORKSPACE_CONFIG`` are also left in ``os.environ`` for the processes this one starts (Ray's
    workers). Raises ``RuntimeError`` when MKL already ran in this process without ``MKL_CBWR``."""
    os.environ.setdefault("MKL_CBWR", DEFAULT_MKL_CBWR)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS initialises
    mkl = _torch_mkl()
    if mkl is not None:
        wanted = _mkl_cbwr_code(os.environ["MKL_CBWR"])
        unset = mkl.mkl_serv_cbwr_get(_MKL_CBWR_ALL) == _MKL_CBWR_BRANCH_OFF  # else MKL read MKL_CBWR
        if unset and mkl.mkl_serv_cbwr_set(wanted) != 0:
            raise RuntimeError(
                "trainer.deterministic: MKL already ran in this process without MKL_CBWR, so its "
                f"reproducible mode can no longer be set; start the process with MKL_CBWR={os.environ['MKL_CBWR']} "
                "in its environment (e.g. MKL_CBWR=AUTO python train.py)"
            )
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def set_torch_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)``, unless torch already runs that many.

    The call is not free at the count torch already has: it also sets MKL's thread count and turns
    MKL's dynamic threading off, and afterwards CPU flash attention (whose products run inside its own
    parallel loop) was several times slower on small problems, other operators unchanged. Measured at
    2 threads on the 2-core machine, one decode step's attention for 128 rows x 2 KV heads x 16 keys:
    90-150 µs in a process that never called it, 420-650 µs after ``torch.set_num_threads(2)``
    (turning MKL's dynamic threading back on recovered only part; the cause was not isolated further)."""
    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def apply_process_settings(trainer: TrainerConfig) -> None:
    """``trainer.torch_threads``, ``trainer.retain_freed_memory`` and ``trainer.deterministic`` (which
    also pins the thread count: ``torch_threads``, or 1), in the process that trains or samples (the
    trainer's own, a Ray learner worker's or rollout actor's)."""
    if trainer.deterministic:
        deterministic_settings()
    threads = trainer.torch_threads or (1 if trainer.deterministic else None)
    if threads and trainer.deterministic:
        torch.set_num_threads(threads)  # always: it also fixes MKL's thread count (no dynamic threading)
    elif threads:
        set_torch_threads(threads)
    if trainer.retain_freed_memory:
        retain_freed_memory()
