"""Mixed precision of the learner: the dtype its forward passes compute in (``model.compute_dtype``).

Parameters, their gradients and AdamW's state stay in ``model.dtype``: with fp32 parameters and a
narrower compute dtype they are fp32 master weights, as PyTorch AMP and FSDP's ``MixedPrecision``
keep them (Micikevicius et al. 2018, arXiv 1710.03740). Only the forward runs under
``torch.autocast`` (``autocast``), which casts the inputs of matrix multiplies (linear layers,
attention) to the compute dtype and runs norms, softmax and reductions in fp32; each op's backward
runs in its forward's dtype and gradients reach the fp32 parameters in fp32.

fp32 where it matters, whatever autocast's op lists say:

- the log-softmax, the gathered log-prob and the entropy of the PPO ratio: the logits are upcast
  before them and only the head's matrix multiply runs in the compute dtype
  (``agent_r1.train.lm_head``, ``agent_r1.train.learner.full_logits_logprobs``);
- the critic's value head (``agent_r1.train.critic.ValueModel``);
- the loss: ``Learner.update`` leaves autocast once the forward returns.

float16 (5 exponent bits: small gradients flush to zero) is loss-scaled by ``torch.amp.GradScaler``
on the learner's device, CUDA or CPU alike (``grad_scaler``); it needs fp32 parameters and one
replica per worker (refused with ``model.dtype: bfloat16`` and with FSDP2, whose sharded gradients
would give each worker its own overflow check). bfloat16 has fp32's exponent range and needs no
scaling.

``auto`` picks bfloat16 where the hardware multiplies it faster than fp32 (``resolve_compute_dtype``).
"""

from __future__ import annotations

import contextlib
import platform
from collections.abc import Iterable
from pathlib import Path

import torch

__all__ = [
    "COMPUTE_DTYPES",
    "CPU_FLAGS",
    "autocast",
    "cpu_flags",
    "cpu_model",
    "grad_scaler",
    "resolve_compute_dtype",
]

COMPUTE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CPU_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512fp16")
"""The x86 flags that say how fast this CPU multiplies 16-bit floats: AVX-512 bf16 dot products
(2x fp32's rate per instruction at best), AMX tiles with bf16 (Sapphire Rapids on: ~8-16x) and
AVX-512 fp16 arithmetic."""


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux
        return ""


def _cpuinfo_field(name: str) -> str | None:
    for line in _cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def cpu_flags() -> tuple[str, ...]:
    """Which of ``CPU_FLAGS`` this CPU reports (Linux's /proc/cpuinfo; none elsewhere)."""
    reported = set((_cpuinfo_field("flags") or "").split())
    return tuple(flag for flag in CPU_FLAGS if flag in reported)


def cpu_model() -> str:
    """This CPU's model name, for benchmark reports."""
    return _cpuinfo_field("model name") or platform.processor() or platform.machine()


def resolve_compute_dtype(
    name: str, device: torch.device, *, flags: Iterable[str] | None = None
) -> tuple[torch.dtype, str]:
    """``model.compute_dtype`` (or ``rollout.compute_dtype``: the same rule) on ``device`` as a torch
    dtype, and a one-line reason. ``auto``: bfloat16 on a CUDA device that computes it natively
    (Ampere on), or on a CPU with AVX-512 bf16 dot products or AMX (``avx512_bf16`` / ``amx_bf16``
    among ``flags``, default ``cpu_flags()``), else float32. On an AMD EPYC with avx512_bf16 alone
    (2 threads) SmolLM2-135M's learner update ran 1.53x faster in bf16 than in fp32; the quickstart's
    tiny model (hidden 128) ran 0.85x, its products too small for the bf16 kernels to pay
    (benchmarks/HISTORY.md, issue 63)."""
    if name != "auto":
        return COMPUTE_DTYPES[name], f"{name}: as configured"
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported(including_emulation=False):
            return torch.bfloat16, "bfloat16: this CUDA device computes it natively"
        return torch.float32, "float32: this CUDA device has no native bfloat16"
    if device.type == "cpu":
        reported = set(cpu_flags() if flags is None else flags)
        native = [flag for flag in ("amx_bf16", "avx512_bf16") if flag in reported]
        if native:
            return torch.bfloat16, f"bfloat16: this CPU multiplies it natively ({', '.join(native)})"
        return torch.float32, "float32: this CPU has neither avx512_bf16 nor AMX"
    return torch.float32, f"float32: no bfloat16 rule for {device.type} devices"


def autocast(model, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` to ``dtype`` on ``model``'s device when ``dtype`` is narrower than its
    parameters; else nothing, and the forward runs in the parameters' dtype (``dtype`` None, the
    same, or wider: autocast only narrows)."""
    parameter = next(model.parameters())
    if dtype is None or dtype.itemsize >= parameter.dtype.itemsize:
        return contextlib.nullcontext()
    return torch.autocast(parameter.device.type, dtype=dtype)


def grad_scaler(model, dtype: torch.dtype | None) -> torch.amp.GradScaler | None:
    """A dynamic loss scaler for float16 compute under ``model``'s wider parameters, else None."""
    parameter = next(model.parameters())
    if dtype != torch.float16 or parameter.dtype == torch.float16:
        return None
    return torch.amp.GradScaler(parameter.device.type)
