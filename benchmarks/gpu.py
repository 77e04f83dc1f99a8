"""The one-GPU check: learner throughput and MFU, engine decode, vLLM weight sync and sleep, and full
colocated train steps, on one CUDA device, at each compute type of ``--dtypes``; all of it within
``--budget-s`` (8 minutes by default: a lent GPU has 15 in all, its start included), what does not
fit a skipped row.

Sections, each at each type in a fresh process of its own (so that one section's memory, crash or
hang cannot reach the next; each gets a time limit inside ``--budget-s``):

  hf          a Qwen2.5-0.5B-shaped model (hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate
              4864, vocab 151,936, tied embeddings; random init, fp32 parameters): the learner's
              log-prob forward + backward (``micro_batch_logprobs`` with entropy, the forward under
              the learner's autocast at a narrower type) on one packed micro-batch of 8k and of 32k tokens,
              tokens/s, MFU and peak memory, under SDPA and flash-attention (fp16 / bf16 only); then
              ``HFEngine`` decode tokens/s at batch 256 on the same model (``compute_dtype``: the type);
  vllm        the same model in ``VLLMEngine`` at the type (vLLM's own ``dtype``; sleep mode on):
              start-up, decode tokens/s at batch 256, seconds to push a new set of fp32 weights
              (``update_weights``), memory freed by ``sleep``, seconds to ``wake``;
  train-hf    full ``Trainer.train_step`` calls on one device: the 0.5B body with the byte-level tiny
  train-vllm  tokenizer's vocabulary (the tokenizer must match the model), the arithmetic task's real
  train-async ``ToolEnv``, GRPO; the HF engine sharing the learner's model, then vLLM colocated with
              the learner and asleep during each update, then ``trainer.mode: async`` (the HF engine
              on its own copy samples step k+1 on a rollout thread while step k trains, partial
              rollouts); ``model.dtype`` float32, ``model.compute_dtype`` (the learner's) and
              ``rollout.compute_dtype`` (the sampler's) the type. Step 1 warms up; the last step is
              reported.

Types (``--dtypes``, comma-separated): float32, bfloat16, float16; default float32,bfloat16 on CUDA
(float32 on the CPU). Parameters stay fp32 at every type; each measurement's row names its type.

MFU = model FLOPs / seconds / peak: 6 x N x tokens for the N non-embedding parameters every token
passes through, plus 6 x hidden x vocab per scored token for the LM head (which the learner runs at
the scored positions only); attention's own FLOPs are not counted, as in the 6·N rule. The peak is
``--peak-tflops`` or looked up from the device name (dense bf16; '-' where unknown and on the CPU),
the same for every type: an fp32 row, off the bf16 tensor cores, cannot come near it.

Prints ``machine: ...``, each measurement as a JSON object (lines starting ``RESULT ``; also written
to ``--out FILE.jsonl``), then one markdown table. A measurement that cannot run here (no CUDA, no
vllm, no flash-attn, no time left) is a ``skipped`` row naming why; a section that fails is a
``failed`` row with its error, and the script then exits 1 (after printing everything else).

    python benchmarks/gpu.py                          # one CUDA device (benchmarks/README.md)
    python benchmarks/gpu.py --dtypes bfloat16        # one type only, half the time
    python benchmarks/gpu.py --device cpu --quick     # tiny shapes on the CPU, seconds (run by the tests)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import importlib.util
import itertools
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

QWEN25_05B = {
    "hidden_size": 896,
    "num_layers": 24,
    "num_heads": 14,
    "num_kv_heads": 2,
    "intermediate_size": 4864,
}
QWEN25_VOCAB = 151_936
# Head dim 32, which vLLM's GPU attention kernels take (--quick on a GPU runs the vLLM sections too).
QUICK_SHAPE = {
    "hidden_size": 64,
    "num_layers": 2,
    "num_heads": 2,
    "num_kv_heads": 1,
    "intermediate_size": 192,
}

# Dense bf16 tensor-core peaks from the vendors' data sheets (without sparsity), by device-name
# substring; the first match wins, so the more specific names come first.
PEAK_BF16_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H200", 989.0),
    ("H100", 989.0),
    ("A100", 312.0),
    ("L40S", 362.0),
)

# (section, what it measures, seconds it may take at most on one H200); run in this order.
SECTIONS = (
    ("hf", "learner and HF engine", 150),
    ("vllm", "vLLM engine", 180),
    ("train-hf", "train step (hf)", 150),
    ("train-vllm", "train step (vllm, sleep mode)", 180),
    ("train-async", "train step (hf, async)", 120),
)
GIB = 2**30
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # --dtypes, as the table names them


@dataclass(frozen=True)
class Measurement:
    """One figure (``status`` ok) or why there is none (``skipped`` / ``failed`` and ``reason``)."""

    label: str
    value: float | None = None
    unit: str = ""
    mfu: float | None = None
    peak_gib: float | None = None
    note: str = ""
    status: str = "ok"
    reason: str = ""
    details: dict = field(default_factory=dict)
    dtype: str = ""  # the compute type it was measured at (--dtypes)


def emit(measurement: Measurement) -> None:
    print("RESULT " + json.dumps(asdict(measurement)), flush=True)


# ------------------------------------------------------------------ helpers shared by the sections


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def peak_tflops(args) -> tuple[float | None, str]:
    """The dense bf16 peak for MFU and where it came from."""
    if args.peak_tflops:
        return args.peak_tflops, "--peak-tflops"
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        return None, "no CUDA device"
    name = torch.cuda.get_device_name(torch.device(args.device))
    for key, tflops in PEAK_BF16_TFLOPS:
        if key in name:
            return tflops, f"{name}, from the device name"
    return None, f"{name} is not in the table: pass --peak-tflops"


def version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def installed(package: str) -> bool:
    """Whether ``package`` is importable as a real package (a folder of that name on sys.path, such
    as tests/vllm/, is a namespace package without an origin)."""
    spec = importlib.util.find_spec(package)
    return spec is not None and spec.origin is not None


def device_problem(device: str) -> str | None:
    """Why ``device`` cannot be used here, or None."""
    if device == "cpu":
        return None
    if device != "cuda" and not (device.startswith("cuda:") and device[5:].isdigit()):
        return "must be 'cpu', 'cuda' or 'cuda:N'"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device (the CPU smoke run: --device cpu --quick)"
    if torch.device(device).index is not None and torch.device(device).index >= torch.cuda.device_count():
        return f"there are {torch.cuda.device_count()} CUDA devices"
    return None


def vllm_problem(args) -> str | None:
    """Why the vLLM sections cannot run here, or None."""
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        return f"needs a CUDA device (--device {args.device}; sleep mode is GPU-only)"
    if not installed("vllm"):
        return "the vllm package is not installed"
    return None


def flash_attn_problem(device: torch.device, dtype: torch.dtype) -> str | None:
    if device.type != "cuda":
        return "needs a CUDA device"
    if not installed("flash_attn"):
        return "the flash_attn package is not installed"
    if dtype == torch.float32:
        return "flash-attn runs in fp16 / bf16 only"
    return None


def default_dtypes(device: str) -> str:
    """Both types on CUDA; fp32 alone on the CPU (its smoke run), whose tiny shapes pack no layer."""
    return "float32" if device == "cpu" else "float32,bfloat16"


def model_shape(args) -> dict:
    return dict(QUICK_SHAPE if args.quick else QWEN25_05B)


def build_model(shape: dict, vocab: int, dtype: torch.dtype, device: torch.device, *, seed: int):
    """A random-init Qwen2 of ``shape`` built directly on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_layers"],
        num_attention_heads=shape["num_heads"],
        num_key_value_heads=shape["num_kv_heads"],
        max_position_embeddings=32_768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )
    torch.manual_seed(seed)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def body_parameters(model) -> int:
    """Parameters every token passes through: all but the (tied) token embedding / LM head."""
    embedding = model.get_input_embeddings().weight
    return sum(p.numel() for p in model.parameters() if p is not embedding)


# ------------------------------------------------------------------ section hf: learner + HF engine


def fixed_trajectories(num: int, seq_len: int, vocab: int, seed: int):
    """Append-context 3-turn trajectories whose merged sequence is exactly ``seq_len`` tokens: a prompt
    of 3/8 of it, then 3 responses of 1/8 with 2 observations of 1/8 between them (3/8 scored)."""
    from agent_r1.types import Step, Trajectory

    rng = random.Random(seed)
    part = seq_len // 8
    trajectories = []
    for i in range(num):
        prompt = [rng.randrange(vocab) for _ in range(seq_len - 5 * part)]
        steps = []
        for _ in range(3):
            response = [rng.randrange(vocab) for _ in range(part)]
            steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[0.0] * part))
            prompt = prompt + response + [rng.randrange(vocab) for _ in range(part)]
        trajectories.append(Trajectory(task_id=str(i), steps=tuple(steps)))
    return trajectories


def learner_rows(
    model, args, attention: str, peak: float | None, dtype: torch.dtype
) -> Iterator[Measurement]:
    """Forward + backward of one packed micro-batch per token budget (the learner's update pass), the
    forward under the learner's autocast in ``dtype`` (``agent_r1.models.precision.autocast``: where
    it is narrower than the fp32 parameters; float16 without the learner's loss scaler)."""
    from agent_r1.models.precision import autocast
    from agent_r1.train.batch import batch_of
    from agent_r1.train.learner import micro_batch_logprobs

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    hidden = model.config.hidden_size
    body = body_parameters(model)
    for budget in args.micro_batch_tokens:
        trajectories = fixed_trajectories(budget // args.seq_len, args.seq_len, vocab, seed=budget)
        (mb,) = batch_of(trajectories, micro_batch_tokens=budget).all_micro_batches
        scored = int(mb.target_ids_K.numel())

        def forward_backward(mb=mb) -> None:
            with autocast(model, dtype):
                logprobs_K, entropy_K = micro_batch_logprobs(model, mb, 1.0, with_entropy=True)
            (-logprobs_K.sum() - 0.01 * entropy_K.sum()).backward()
            model.zero_grad(set_to_none=True)

        forward_backward()  # warm-up: kernels, allocator
        reset_peak(device)
        times = []
        for _ in range(args.repeats):
            synchronize(device)
            start = time.perf_counter()
            forward_backward()
            synchronize(device)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        flops = 6 * body * mb.num_tokens + 6 * hidden * vocab * scored
        yield Measurement(
            f"learner {attention}, {budget} tokens/micro-batch",
            mb.num_tokens / seconds,
            "tokens/s",
            mfu=flops / seconds / (peak * 1e12) if peak else None,
            peak_gib=peak_gib(device),
            note=f"fwd+bwd, {mb.input_ids_BT.shape[0]} x {args.seq_len}, {scored} scored, median of {args.repeats}",
            details={"tokens": mb.num_tokens, "scored": scored, "seconds": times, "model_flops": flops},
        )


def hf_decode_row(model, args, dtype: torch.dtype) -> Measurement:
    """``HFEngine`` at ``compute_dtype`` ``dtype``: ``--decode-batch`` concurrent requests of
    ``--prompt-len`` random tokens, each sampling exactly ``--new-tokens`` (end of sequence ignored);
    prefill included in the time."""
    from agent_r1.rollout.hf import HFEngine

    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().num_embeddings
    prompts = random_prompts(args.decode_batch, args.prompt_len, vocab, seed=0)
    engine = HFEngine(model, max_batch_size=args.decode_batch, eos_token_ids=(), compute_dtype=dtype)
    computes_in = str(engine.compute_dtype).removeprefix("torch.")
    try:
        run_requests(engine, random_prompts(4, args.prompt_len, vocab, seed=1), 4)  # warm-up
        reset_peak(device)
        synchronize(device)
        start = time.perf_counter()
        tokens = run_requests(engine, prompts, args.new_tokens)
        synchronize(device)
        seconds = time.perf_counter() - start
    finally:
        engine.close()
    return Measurement(
        f"HF engine decode, batch {args.decode_batch}",
        tokens / seconds,
        "tokens/s",
        peak_gib=peak_gib(device),
        note=(
            f"prompt {args.prompt_len}, {args.new_tokens} new tokens each, prefill included; "
            f"computes in {computes_in}"
        ),
        details={"tokens": tokens, "seconds": seconds, "compute_dtype": computes_in},
    )


def random_prompts(num: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Distinct prompts (warm-up ones use another seed, so that no prefix cache hits the timed run)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(num)]


def run_requests(engine, prompts: list[list[int]], new_tokens: int) -> int:
    """All ``prompts`` at once through ``engine.generate`` (T=1); returns the tokens generated."""
    from agent_r1.types import SamplingParams

    completions = asyncio.run(
        _gather(engine, prompts, SamplingParams(temperature=1.0, max_tokens=new_tokens))
    )
    errors = [c.error for c in completions if c.error]
    if errors:
        raise RuntimeError(f"{len(errors)} of {len(prompts)} requests failed, first: {errors[0]}")
    return sum(len(c.token_ids) for c in completions)


def greedy_logprobs(engine, prompt: list[int]) -> tuple[float, ...]:
    from agent_r1.types import SamplingParams

    (completion,) = asyncio.run(_gather(engine, [prompt], SamplingParams(temperature=0.0, max_tokens=4)))
    return completion.logprobs


async def _gather(engine, prompts: list[list[int]], params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


def section_hf(args, dtype: str) -> Iterator[Measurement]:
    device, compute = torch.device(args.device), getattr(torch, dtype)
    vocab = len(tiny_tokenizer()) if args.quick else QWEN25_VOCAB
    peak, _ = peak_tflops(args)
    model = build_model(model_shape(args), vocab, torch.float32, device, seed=0)
    yield from learner_rows(model, args, "sdpa", peak, compute)
    yield hf_decode_row(model, args, compute)
    problem = flash_attn_problem(device, compute)
    if problem is not None:
        for budget in args.micro_batch_tokens:
            yield Measurement(
                f"learner flash-attn, {budget} tokens/micro-batch", status="skipped", reason=problem
            )
        return
    model.set_attn_implementation("flash_attention_2")
    yield from learner_rows(model, args, "flash-attn", peak, compute)


def tiny_tokenizer():
    from agent_r1.models.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


# ------------------------------------------------------------------ section vllm


def section_vllm(args, dtype: str) -> Iterator[Measurement]:
    with tempfile.TemporaryDirectory() as tmp:  # the model folder outlives the engine
        yield from vllm_rows(Path(tmp), args, dtype)


def vllm_rows(folder: Path, args, dtype: str) -> Iterator[Measurement]:
    """vLLM at ``dtype`` (its own ``dtype``) over an fp32 checkpoint, pushed fp32 weights as a learner
    with fp32 parameters would push them."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from agent_r1.rollout.vllm_engine import VLLMEngine
    from agent_r1.train.backends import export_weights

    device = torch.device(args.device)
    shape = model_shape(args)
    model = build_model(shape, QWEN25_VOCAB, torch.float32, device, seed=0)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    torch.cuda.empty_cache()  # vLLM sizes its memory from what the device has free
    start = time.perf_counter()
    # No tokenizer: this model has Qwen2.5's vocabulary and none of its tokenizer files; the
    # engine's work is token ids in, token ids and log-probs out.
    engine = VLLMEngine(
        str(folder),
        ignore_eos=True,
        dtype=dtype,
        gpu_memory_utilization=args.vllm_memory,
        enable_sleep_mode=True,
        skip_tokenizer_init=True,
    )
    startup = time.perf_counter() - start
    yield Measurement(
        "vLLM start-up",
        startup,
        "s",
        note=f"gpu_memory_utilization {args.vllm_memory}, sleep mode, compile and CUDA graphs",
    )
    prompts = random_prompts(args.decode_batch, args.prompt_len, QWEN25_VOCAB, seed=0)
    run_requests(engine, random_prompts(4, args.prompt_len, QWEN25_VOCAB, seed=1), 4)  # warm-up
    start = time.perf_counter()
    tokens = run_requests(engine, prompts, args.new_tokens)
    seconds = time.perf_counter() - start
    yield Measurement(
        f"vLLM decode, batch {args.decode_batch}",
        tokens / seconds,
        "tokens/s",
        note=f"prompt {args.prompt_len}, {args.new_tokens} new tokens each, prefill included",
        details={"tokens": tokens, "seconds": seconds},
    )
    trained = build_model(shape, QWEN25_VOCAB, torch.float32, device, seed=1)  # "new weights"
    weights = export_weights(trained)
    before = greedy_logprobs(engine, prompts[0])
    synchronize(device)
    start = time.perf_counter()
    engine.update_weights(weights, version=1)
    synchronize(device)
    seconds = time.perf_counter() - start
    if greedy_logprobs(engine, prompts[0]) == before:
        raise RuntimeError("vLLM weight sync: the engine's greedy log-probs did not change")
    size = sum(t.numel() * t.element_size() for _, t in weights)
    yield Measurement(
        "vLLM weight sync",
        seconds,
        "s",
        note=f"update_weights of {len(weights)} tensors, {size / GIB:.2f} GiB; the engine's output changed",
        details={"parameters": params, "bytes": size},
    )
    del trained, weights
    torch.cuda.empty_cache()
    free_awake = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    engine.sleep()
    synchronize(device)
    sleep_s = time.perf_counter() - start
    free_asleep = torch.cuda.mem_get_info(device)[0]
    yield Measurement(
        "vLLM memory freed by sleep",
        (free_asleep - free_awake) / GIB,
        "GiB",
        note=f"sleep(level=1) took {sleep_s:.2f} s (weights to host memory, KV cache dropped)",
        details={"sleep_seconds": sleep_s, "free_awake": free_awake, "free_asleep": free_asleep},
    )
    start = time.perf_counter()
    engine.wake()
    synchronize(device)
    wake_s = time.perf_counter() - start
    run_requests(engine, prompts[:4], 4)  # the woken engine still samples
    yield Measurement("vLLM wake", wake_s, "s", note="wake_up, then 4 requests sampled")


# ------------------------------------------------------------------ sections train-hf, train-vllm


def train_config(args, model_path: Path, run_dir: Path, engine: str, dtype: str, mode: str = "sync"):
    from agent_r1.train.config import config_from_dict

    quick = args.quick
    rollout = {
        "n": 2 if quick else 8,
        "max_tokens": 8 if quick else 128,
        "max_steps": 2 if quick else 4,
        "max_batch_size": 256,
        "engine": engine,
        "compute_dtype": dtype,  # the sampler's type, the learner's too (model.compute_dtype)
    }
    if engine == "vllm":
        rollout["engine_kwargs"] = {"gpu_memory_utilization": args.vllm_memory, "enable_sleep_mode": True}
    if mode == "async":  # the engine samples from its own copy; the PPO ratio against the sampler
        rollout["share_model"] = False
    return config_from_dict(
        {
            "model": {
                "path": str(model_path),
                "dtype": "float32",
                "compute_dtype": dtype,
                "device": args.device,
            },
            "env": {"name": "agent_r1.tasks.prepare:task_env", "kwargs": {"task": "arithmetic"}},
            "rollout": rollout,
            "trainer": {
                "steps": args.train_steps,
                "tasks_per_step": 2 if quick else 32,
                "mini_batches": 1 if quick else 2,
                "micro_batch_tokens": 4096 if quick else 16_384,
                "run_dir": str(run_dir),
                "mode": mode,
            },
            "algorithm": {"old_logprobs": "sampler"} if mode == "async" else {},
            "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False, "report": False},
        }
    )


def section_train(args, dtype: str, engine: str, mode: str = "sync") -> Iterator[Measurement]:
    if engine == "vllm":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from agent_r1.models.tiny import save_tiny_checkpoint
    from agent_r1.tasks.arithmetic import make_dataset
    from agent_r1.train.data import TaskSampler
    from agent_r1.train.trainer import Trainer

    device = torch.device(args.device)
    label = "train step (hf)" if engine == "hf" else "train step (vllm, sleep mode)"
    if mode == "async":
        label = "train step (hf, async)"
    with tempfile.TemporaryDirectory() as tmp:
        model_path = save_tiny_checkpoint(
            Path(tmp) / "model", max_position_embeddings=4096, **model_shape(args)
        )
        config = train_config(args, model_path, Path(tmp) / "run", engine, dtype, mode)
        cfg = config.trainer
        trainer = Trainer(config, train_tasks=make_dataset(cfg.tasks_per_step * cfg.steps))
        try:
            params = sum(p.numel() for p in trainer.model.parameters())
            trainer.sampler = TaskSampler(trainer.train_tasks, cfg.tasks_per_step, seed=cfg.seed)
            steps = []
            for step in range(1, cfg.steps + 1):
                reset_peak(device)
                steps.append(trainer.train_step(step))
        finally:
            trainer.close()
    last = steps[-1]
    note = (
        f"step {len(steps)} of {len(steps)}; {params / 1e6:.1f}M params (the hf section's body, the tiny "
        f"tokenizer's {len(trainer.tokenizer)} tokens), {cfg.tasks_per_step} tasks x {config.rollout.n} samples"
    )
    peak = peak_gib(device)
    yield Measurement(
        f"{label}: step", last["time/step"], "s", peak_gib=peak, note=note, details={"steps": steps}
    )
    for phase in ("rollout", "reference", "update", "sync"):
        yield Measurement(f"{label}: {phase}", last.get(f"time/{phase}", 0.0), "s")
    if mode == "async":
        from agent_r1.report.html import overlap_fraction, phase_timeline

        timeline = phase_timeline([{**m, "step": k} for k, m in enumerate(steps, 1)][1:])
        yield Measurement(
            f"{label}: update time beside a rollout",
            100 * (overlap_fraction(timeline) or 0.0),
            "%",
            note=f"staleness max {max(m.get('async/staleness_max', 0.0) for m in steps):.0f}",
        )
    yield Measurement(
        f"{label}: sampled tokens/s",
        last["throughput/tokens_per_s"],
        "tokens/s",
        note=f"{last['train/tokens']:.0f} tokens trained",
    )


def run_section(name: str, args, dtype: str) -> None:
    """In the child process: run one section at ``dtype``, one RESULT line per measurement."""
    sections = {
        "hf": section_hf,
        "vllm": section_vllm,
        "train-hf": lambda a, t: section_train(a, t, "hf"),
        "train-vllm": lambda a, t: section_train(a, t, "vllm"),
        "train-async": lambda a, t: section_train(a, t, "hf", "async"),
    }
    for measurement in sections[name](args, dtype):
        emit(replace(measurement, dtype=dtype))


# ------------------------------------------------------------------ the parent: sections, table


def run_child(name: str, title: str, dtype: str, timeout: float) -> tuple[list[Measurement], str | None]:
    """Run section ``name`` at ``dtype`` in a fresh process; returns its measurements and why it
    failed (or None)."""
    argv = [*sys.argv[1:], "--section", name, "--dtypes", dtype]  # (the last --dtypes wins)
    proc = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends the compile workers too
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        failure = None if proc.returncode == 0 else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        failure = f"timed out after {timeout:.0f} s"
    measurements = [
        Measurement(**json.loads(line.removeprefix("RESULT ")))
        for line in stdout.splitlines()
        if line.startswith("RESULT ")
    ]
    if failure is not None:
        tail = [line for line in stderr.strip().splitlines() if line.strip()][-1:] or ["(no stderr)"]
        failure = f"{failure}: {tail[0][:200]}"
        print(f"--- {title} ({name}, {dtype}) failed; its stderr ends:\n{stderr[-4000:]}", file=sys.stderr)
    return measurements, failure


def cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def print_table(measurements: list[Measurement]) -> None:
    width = max(len(m.label) for m in measurements)
    columns = f"type | {'value':>10} | {'unit':<8} | {'MFU':>6} | {'peak GiB':>8} | note"
    print(f"| {'measurement':<{width}} | {columns} |")
    print(f"|{'-' * (width + 2)}|------|{'-' * 12}|{'-' * 10}|{'-' * 8}|{'-' * 10}|------|")
    for m in measurements:
        if m.status == "ok":
            value = cell(m.value, 1 if m.unit == "tokens/s" else 3)
            mfu = "-" if m.mfu is None else f"{100 * m.mfu:.1f}%"
            note = m.note
        else:
            value, mfu, note = m.status, "-", m.reason
        print(
            f"| {m.label:<{width}} | {SHORT_NAMES.get(m.dtype, '-'):<4} | {value:>10} | {m.unit or '-':<8} | "
            f"{mfu:>6} | {cell(m.peak_gib, 1):>8} | {note} |"
        )


def machine_line(args) -> str:
    if args.device.startswith("cuda") and torch.cuda.is_available():
        properties = torch.cuda.get_device_properties(torch.device(args.device))
        where = f"{properties.name} {properties.total_memory / GIB:.0f} GiB (CUDA {torch.version.cuda})"
    else:
        where = "CPU only"
    return (
        f"machine: {platform.machine()} {os.cpu_count()} cores, {where}; torch {torch.__version__}, "
        f"transformers {version('transformers')}, vllm {version('vllm')}, flash-attn {version('flash-attn')}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu")
    parser.add_argument(
        "--dtypes",
        help="compute types, comma-separated: float32, bfloat16, float16 (default: float32,bfloat16; "
        "float32 on cpu)",
    )
    parser.add_argument("--micro-batch-tokens", type=int, nargs="+", default=[8192, 32_768])
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens of each packed sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed learner passes after a warm-up")
    parser.add_argument("--decode-batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--train-steps", type=int, default=2, help="train steps per engine; the last is reported"
    )
    parser.add_argument("--vllm-memory", type=float, default=0.3, help="vLLM's gpu_memory_utilization")
    parser.add_argument(
        "--peak-tflops", type=float, help="dense bf16 peak for MFU (default: from the device name)"
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        help="wall-clock limit of all sections and types together (default 480 s: a lent GPU has 15 minutes in all)",
    )
    parser.add_argument("--out", help="also write the JSON objects here, one a line")
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes (hidden 64, 2 layers), 1 train step"
    )
    parser.add_argument("--section", choices=[s for s, _, _ in SECTIONS], help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    problem = device_problem(args.device)
    if problem:
        parser.error(f"--device {args.device}: {problem}")
    args.dtypes = list(dict.fromkeys((args.dtypes or default_dtypes(args.device)).split(",")))
    unknown = [dtype for dtype in args.dtypes if dtype not in SHORT_NAMES]
    if unknown:
        parser.error(f"--dtypes {','.join(unknown)}: each must be one of {', '.join(SHORT_NAMES)}")
    args.budget_s = args.budget_s or 480.0
    if args.quick:
        args.micro_batch_tokens, args.seq_len, args.repeats = [512, 1024], 256, 1
        args.decode_batch, args.prompt_len, args.new_tokens, args.train_steps = 8, 16, 8, 1
    if any(budget % args.seq_len for budget in args.micro_batch_tokens):
        parser.error(f"--micro-batch-tokens must be multiples of --seq-len {args.seq_len}")
    if args.section:
        (dtype,) = args.dtypes  # the parent passes one
        run_section(args.section, args, dtype)
        return

    print(machine_line(args), flush=True)
    peak, source = peak_tflops(args)
    shape = model_shape(args)
    print(
        f"model: Qwen2 hidden {shape['hidden_size']}, {shape['num_layers']} layers, {shape['num_heads']} heads "
        f"({shape['num_kv_heads']} KV), intermediate {shape['intermediate_size']}, tied embeddings, random "
        f"init, fp32 parameters computing in {', '.join(args.dtypes)}; vocab "
        f"{'the tiny tokenizer' if args.quick else QWEN25_VOCAB} (train steps: the tiny tokenizer's); "
        f"peak for MFU: {cell(peak, 0)} TFLOP/s ({source})",
        flush=True,
    )
    skip_vllm = vllm_problem(args)
    deadline = time.monotonic() + args.budget_s
    measurements: list[Measurement] = []
    failed = False
    for (name, title, limit), dtype in itertools.product(SECTIONS, args.dtypes):
        left = deadline - time.monotonic()
        if name in ("vllm", "train-vllm") and skip_vllm:
            found, failure = [Measurement(title, dtype=dtype, status="skipped", reason=skip_vllm)], None
        elif left < 30:
            found = [Measurement(title, dtype=dtype, status="skipped", reason="no time left in --budget-s")]
            failure = None
        else:
            found, failure = run_child(name, title, dtype, min(limit, left))
        if failure is not None:
            found.append(Measurement(title, dtype=dtype, status="failed", reason=failure))
            failed = True
        measurements += found
        lines = [json.dumps(asdict(m)) for m in found]
        print("".join(f"RESULT {line}\n" for line in lines), end="", flush=True)
        if args.out:  # rewritten after every section: a run cut short keeps what it measured
            Path(args.out).write_text("".join(json.dumps(asdict(m)) + "\n" for m in measurements))
    print_table(measurements)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
