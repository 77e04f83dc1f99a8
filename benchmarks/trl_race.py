"""What ``vs_trl.py`` (single turn) and ``vs_trl_multiturn.py`` (tool calling) share: the GRPO settings
both frameworks get, the per-iteration clock, TRL's training call, the run-each-framework loop, the
common arguments, the machine line and the table.

Not a benchmark itself. The settings here are the ones that make "same algorithm" true: GRPO
group-std advantages, PPO clip 0.2 / 0.28, token-mean loss (TRL ``loss_type="dapo"``), no KL
(``kl.coef`` / ``beta`` = 0), temperature 1 with no top-p / top-k, a constant lr, AdamW betas
0.9/0.999 without weight decay, grad-norm clip 1.0, one optimizer step per iteration.
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

TRL = "TRL GRPOTrainer"
"""The race's name for TRL's side (its row in the printed tables)."""

# agent-r1's side of the equal settings (the config's ``algorithm`` section).
EQUAL_ALGORITHM = {
    "advantage": "grpo",
    "policy_loss": {"name": "ppo_clip", "clip_low": 0.2, "clip_high": 0.28},
    "loss_aggregation": "token-mean",
    "kl": {"coef": 0.0},
}


class Clock:
    """Wall-clock and process CPU time at the start of every iteration (and at the end of training).

    CPU seconds (all threads of this process) are less sensitive than wall seconds to other processes
    competing for the cores, so both are reported.
    """

    def __init__(self) -> None:
        self.marks: list[tuple[float, float]] = []

    def mark(self) -> None:
        self.marks.append((time.perf_counter(), time.process_time()))

    def gaps(self) -> dict[str, list[float]]:
        pairs = list(zip(self.marks, self.marks[1:], strict=False))
        return {"gaps": [b[0] - a[0] for a, b in pairs], "cpu_gaps": [b[1] - a[1] for a, b in pairs]}


def clock_steps(trainer) -> Clock:
    """Mark the start of every agent-r1 ``train_step`` (instrumentation only): a gap then covers the
    step and the loop's logging, as TRL's ``on_step_begin`` gaps do. Call ``mark()`` once more at the end."""
    clock = Clock()
    train_step = trainer.train_step

    def timed_step(step: int) -> dict[str, float]:
        clock.mark()
        return train_step(step)

    trainer.train_step = timed_step
    return clock


def trl_config(out_dir: Path, *, batch: int, group_size: int, max_completion_length: int, args, **extra):
    """TRL's ``GRPOConfig`` with the equal settings; ``args`` gives ``lr``, ``seed`` (and ``iterations``
    unless ``extra`` sets ``max_steps``); ``extra`` adds or replaces fields."""
    from trl import GRPOConfig

    fields = {
        "output_dir": str(out_dir),
        "use_cpu": True,
        "per_device_train_batch_size": batch,
        "gradient_accumulation_steps": 1,
        "num_generations": group_size,
        "max_completion_length": max_completion_length,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "beta": 0.0,
        "epsilon": 0.2,
        "epsilon_high": 0.28,
        "loss_type": "dapo",
        "scale_rewards": "group",
        "num_iterations": 1,
        "learning_rate": args.lr,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        "weight_decay": 0.0,
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "max_grad_norm": 1.0,
        "max_steps": getattr(args, "iterations", None),
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "seed": args.seed,
        "dataloader_num_workers": 0,
        "disable_tqdm": True,
        # TRL's defaults differ from TrainingArguments': bf16 on and activation checkpointing on. Both
        # would cost TRL time here (bf16 autocast is slow on most CPUs; agent-r1 trains in float32 and
        # without checkpointing), so both are off.
        "bf16": False,
        "activation_checkpointing": False,
        **extra,
    }
    return GRPOConfig(**fields)


def train_trl(make_trainer: Callable[[list], object], budget_s: float | None = None):
    """Build TRL's trainer with ``make_trainer(callbacks)`` and train it; returns (trainer, clock).

    The clock marks the start of every optimizer step and the end of training. With ``budget_s``,
    training stops at the first step end after that many wall-clock seconds since training began (a
    step that has started is finished, as ``multiturn.train_for`` does for agent-r1).
    """
    from transformers import PrinterCallback, TrainerCallback

    clock = Clock()
    started = [0.0]

    class Marks(TrainerCallback):
        def on_train_begin(self, *a, **k):
            started[0] = time.perf_counter()

        def on_step_begin(self, *a, **k):
            clock.mark()

        def on_step_end(self, args, state, control, **k):
            if budget_s is not None and time.perf_counter() - started[0] >= budget_s:
                control.should_training_stop = True

        def on_train_end(self, *a, **k):
            clock.mark()

    trainer = make_trainer([Marks()])
    trainer.remove_callback(PrinterCallback)  # its per-step dict printing would bury the table
    trainer.train()
    return trainer, clock


def race(
    runs: dict[str, Callable[[], dict]], score: Callable[[dict], object], *, seed: int, length: str, progress
):
    """Run each framework in turn from the same torch seed; each result gets ``total`` (wall seconds
    of its run, unless the run timed itself), ``heldout`` (``score(result)``, which may pop the
    trained model from it), and ``probe`` / ``probe_after``: ``speed_probe()`` just before the run
    and just after it (the next run's probe)."""
    results = {}
    for name, run in runs.items():
        probe = speed_probe()
        progress(f"training {name} for {length} (speed probe {probe:.3f} s)")
        torch.manual_seed(seed)
        started = time.perf_counter()
        result = run()
        result.setdefault("total", time.perf_counter() - started)
        result["probe"] = probe
        result["heldout"] = score(result)
        results[name] = result
    after = speed_probe()
    progress(f"speed probe after the last run: {after:.3f} s")
    ordered = list(results.values())
    for result, following in zip(ordered, [*ordered[1:], None], strict=True):
        result["probe_after"] = after if following is None else following["probe"]
    return results


def probe_line(results: dict) -> str:
    """The speed probes of a race, for its printout."""
    probes = ", ".join(f"{name} {r['probe']:.3f} -> {r['probe_after']:.3f} s" for name, r in results.items())
    return f"speed probe (a fixed workload, lower is faster; before -> after each run): {probes}"


def speed_probe(rounds: int = 3) -> float:
    """Seconds for a fixed workload on this process's threads (the best of ``rounds``): four times
    64 products of 256 x 256 matrices and 8 passes over 64 MiB, the two kinds of work a small
    model's step does (0.15 s on one thread of the 2-core machine). The host's speed drifts over
    minutes (a shared machine); equal probes before each framework say a race's ratios are not
    that drift."""
    a = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    big = torch.zeros(16 * 2**20)
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(4):
            for _ in range(64):
                b = a @ a
            for _ in range(8):
                big.add_(1.0)
        best = min(best, time.perf_counter() - started)
    del b
    return best


def train_in_fresh_process(train: Callable, *args, threads: int, seed: int) -> dict:
    """``train(*args)`` in a spawned interpreter of its own, on ``threads`` torch threads from torch
    seed ``seed``; its result dict with ``total``, the seconds ``train`` took (the interpreter's
    start left out). ``train`` lives at a module's top level; arguments and result are picklable.
    A race trains each framework this way so that none inherits what the process did before: the
    warm start, the evaluations, another framework's heap or process-wide settings."""
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(_timed, (train, threads, seed, args))
    finally:  # let the child exit by itself (terminating it would leave its semaphores behind)
        pool.close()
        pool.join()


def _timed(train: Callable, threads: int, seed: int, args: tuple) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    started = time.perf_counter()
    result = train(*args)
    result["total"] = time.perf_counter() - started
    return result


def median_after(values: list[float], warmup: int) -> float:
    """The median of ``values`` after the first ``warmup`` (all of them when there are not more)."""
    return statistics.median(values[warmup:] if len(values) > warmup else values)


def machine_line(with_trl: bool) -> str:
    import transformers

    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    if with_trl:
        import trl

        versions += f", trl {trl.__version__}"
    return (
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"{versions}, threads {torch.get_num_threads()}"
    )


def progress_printer(name: str) -> Callable[[str], None]:
    def progress(message: str) -> None:
        print(f"[{name} {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    return progress


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    """A right-aligned markdown table (first column left-aligned), each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        return (
            "| "
            + " | ".join([first, *(c.rjust(w) for c, w in zip(cells[1:], widths[1:], strict=True))])
            + " |"
        )

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def add_race_arguments(parser: argparse.ArgumentParser, variant_example: str) -> None:
    """``--skip-trl`` and ``--variant`` (extra agent-r1 rows with config overrides)."""
    parser.add_argument(
        "--skip-trl", action="store_true", help="agent-r1 only (no ratios), e.g. where trl is not installed"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help=f"an extra agent-r1 row with these config overrides, e.g. {variant_example} (repeatable)",
    )


def require_trl(args, script: str) -> None:
    """Exit with a message naming the fix when TRL is needed (no ``--skip-trl``) but not installed."""
    if not args.skip_trl and importlib.util.find_spec("trl") is None:
        sys.exit(f"{script}: trl is not installed (pip install -e '.[bench]'), or pass --skip-trl")
