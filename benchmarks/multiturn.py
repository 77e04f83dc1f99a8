"""The quickstart task at a fixed wall-clock RL budget: ``append`` vs ``rerender`` context.

Runs the ``agent-r1 quickstart`` pipeline (``agent_r1/commands/quickstart.py``) once per context
policy, in this process, with the same seed, data and settings:

1. the tiny Qwen2 + byte-level ChatML tokenizer, supervised warm start on the imperfect demonstrator,
   each demonstration replayed through the ``ToolEnv`` with that context policy (so the SFT tokens are
   the ones RL will see);
2. held-out success of the warm start (sampled at temperature 1, ``quickstart.EVAL_SAMPLES`` episodes
   per task, as the quickstart measures it);
3. RL with the real trainer (multi-step rollouts, GRPO, PPO-clip, dynamic filtering; quickstart's
   settings) for ``--minutes`` of wall clock: training steps run until the budget is spent (a step that
   has started is finished);
4. held-out success after RL, and each trainer phase's share of the RL time, from the step
   metrics (``time/rollout``, ``time/score``, ``time/reference``, ``time/update``, ``time/sync``; the
   small ``filter`` and ``advantage`` phases are reported as "other").

Prints machine info and one table, with the ``rerender`` / ``append`` ratio of the figures that
compare. Only ratios inside one run are meaningful on a shared machine.

    python benchmarks/multiturn.py               # quickstart's warm start, 3 minutes of RL per context
    python benchmarks/multiturn.py --minutes 10  # longer budget
    python benchmarks/multiturn.py --quick       # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from agent_r1.commands import quickstart
from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.tasks import arithmetic, get_task
from agent_r1.train.config import config_from_dict
from agent_r1.train.data import TaskSampler
from agent_r1.train.run_dir import RunDir
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer

CONTEXTS = ("append", "rerender")
PHASES = ("rollout", "score", "reference", "update", "sync")


def own_step_loop(trainer: Trainer, run_dir: Path) -> None:
    """Set up ``trainer`` for a caller that runs ``train_step`` itself (to its own budget) instead of
    ``Trainer.fit``: the task sampler and the run directory (dumped trajectories) that fit makes."""
    cfg = trainer.config.trainer
    trainer.sampler = TaskSampler(trainer.train_tasks, cfg.tasks_per_step, seed=cfg.seed, shuffle=True)
    trainer.run_dir = RunDir(str(run_dir), trainer.config)


def train_for(trainer: Trainer, seconds: float, run_dir: Path, after_step=None) -> list[dict]:
    """Training steps until ``seconds`` of wall clock are spent; returns each step's metrics.

    ``Trainer.fit`` runs a fixed number of steps; this is its loop with a clock instead (the same
    task sampler and run directory, no checkpoints, evaluation left to the caller). ``after_step(step)``
    runs after each step, outside nothing but the budget.
    """
    own_step_loop(trainer, run_dir)
    cfg = trainer.config.trainer
    rows = []
    started = time.perf_counter()
    try:
        step = 0
        while time.perf_counter() - started < seconds and step < cfg.steps:
            step += 1
            trainer.step = step
            metrics = trainer.train_step(step)
            trainer.run_dir.log(step, metrics)
            rows.append(metrics)
            if after_step is not None:
                after_step(step)
    finally:
        trainer.run_dir.close()
    return rows


def make_env(tokenizer, context: str):
    return arithmetic.make_env(tokenizer, max_turns=get_task("arithmetic").max_turns, context=context)


def warm_starts(tokenizer, args, contexts: tuple[str, ...] = CONTEXTS) -> dict[str, tuple[object, str]]:
    """The SFT warm start for each context policy in ``contexts``: (model, how it was made).

    The demonstrations are replayed through each context's env; when both give identical training
    sequences (the byte-level tokenizer round-trips, so they usually do) one SFT serves both (copied),
    otherwise each context gets its own.
    """
    spec = get_task("arithmetic")
    demo_tasks = spec.make_dataset(args.sft_demos, split="train", seed=args.seed + 1)
    sequences = {
        context: sft_sequences(
            replay_demonstrations(
                lambda c=context: make_env(tokenizer, c),
                tokenizer,
                demo_tasks,
                spec.demonstrate,
                seed=args.seed,
            )
        )
        for context in contexts
    }
    trained: dict[str, tuple[object, str]] = {}
    for context in contexts:
        same = next((c for c in trained if sequences[c] == sequences[context]), None)
        if same is not None:
            trained[context] = (copy.deepcopy(trained[same][0]), f"same sequences as {same}: copied")
            continue
        started = time.perf_counter()
        torch.manual_seed(args.seed)
        model = build_tiny_model(
            len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=args.seed,
        )
        train_sft(
            model,
            sequences[context],
            SFTConfig(epochs=args.sft_epochs, batch_size=16, micro_batch_size=16, seed=args.seed),
            pad_token_id=tokenizer.pad_token_id,
        )
        trained[context] = (model, f"SFT {time.perf_counter() - started:.0f}s")
    return trained


def budgeted_settings(args, run_dir: Path, threads: int | None) -> dict:
    """The quickstart's RL config sections for a wall-clock-budgeted run (``train_for``): steps without
    end, the model passed in (no ``model.path``), no progress bar, TensorBoard or trajectory dumps."""
    settings = quickstart.rl_settings(
        steps=10_000,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        seed=args.seed,
        run_dir=str(run_dir),
        threads=threads,
    )
    return {
        **settings,
        "model": {"path": ""},
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
    }


def run_rl(context: str, tokenizer, model, args, out: Path) -> dict:
    """Held-out evaluation, budgeted RL, held-out evaluation; for one context policy."""
    spec = get_task("arithmetic")
    # Far more tasks than the budget can use: the data order never wraps around.
    rl_tasks = spec.make_dataset(4000, split="train", seed=args.seed)
    heldout = spec.make_dataset(args.eval_tasks, split="test", seed=args.seed)

    # quickstart's RL settings, with the context policy and no checkpoints or dumps inside the timed loop.
    config = config_from_dict(budgeted_settings(args, out / context, args.threads))
    trainer = Trainer(
        config,
        tokenizer=tokenizer,
        model=model,
        env_factory=lambda: make_env(tokenizer, context),
        train_tasks=rl_tasks,
        val_tasks=heldout,
    )
    try:
        before = trainer.evaluate()["eval/success"]
        rows = train_for(trainer, args.minutes * 60, out / context)
        after = trainer.evaluate()["eval/success"]
    finally:
        trainer.close()
    step_seconds = sum(r["time/step"] for r in rows)
    shares = {phase: sum(r.get(f"time/{phase}", 0.0) for r in rows) / step_seconds for phase in PHASES}
    shares["other"] = 1.0 - sum(shares.values())
    return {
        "before": before,
        "after": after,
        "steps": len(rows),
        "rl_seconds": step_seconds,
        "seconds_per_step": statistics.median(r["time/step"] for r in rows),
        "train_tokens": statistics.mean([r["train/tokens"] for r in rows if "train/tokens" in r] or [0.0]),
        "turns": statistics.mean(r["steps_per_trajectory/mean"] for r in rows),
        "shares": shares,
    }


def progress(message: str) -> None:
    print(f"[multiturn {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def add_quickstart_arguments(parser: argparse.ArgumentParser) -> None:
    """The quickstart's warm-start, evaluation and RL sizes, and the torch threads (shared with
    ``vs_trl_multiturn.py``)."""
    parser.add_argument(
        "--sft-demos", type=int, default=quickstart.DEFAULTS["sft_demos"], help="warm-start demonstrations"
    )
    parser.add_argument("--sft-epochs", type=int, default=quickstart.DEFAULTS["sft_epochs"])
    parser.add_argument(
        "--eval-tasks", type=int, default=quickstart.DEFAULTS["eval_tasks"], help="held-out tasks (sampled)"
    )
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: steadier than 2 on a shared 2-core machine, see benchmarks/README.md)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="wall-clock RL budget per context")
    add_quickstart_arguments(parser)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.sft_demos, args.sft_epochs, args.eval_tasks = 0.1, 64, 1, 8
        args.tasks_per_step, args.group_size = 4, 2

    torch.set_num_threads(args.threads)
    tokenizer = build_tiny_tokenizer()
    progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
    models = warm_starts(tokenizer, args)
    results = {}
    with tempfile.TemporaryDirectory(prefix="multiturn_") as tmp:
        for context in CONTEXTS:
            progress(f"RL with context={context} for {args.minutes:g} min")
            results[context] = run_rl(context, tokenizer, models[context][0], args, Path(tmp))

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(
        f"task: quickstart arithmetic (calculator tool, <= 4 turns); SFT {args.sft_demos} demos x "
        f"{args.sft_epochs} epochs; RL budget {args.minutes:g} min per context, {args.tasks_per_step} tasks x "
        f"{args.group_size} samples per step; held-out success on {args.eval_tasks} tasks x "
        f"{quickstart.EVAL_SAMPLES} sampled"
    )
    columns = [
        ("held-out success after SFT", lambda r: f"{r['before']:.3f}", None),
        ("held-out success after RL", lambda r: f"{r['after']:.3f}", None),
        ("RL steps in budget", lambda r: f"{r['steps']}", "steps"),
        ("s/step (median)", lambda r: f"{r['seconds_per_step']:.2f}", "seconds_per_step"),
        ("trained tokens/step", lambda r: f"{r['train_tokens']:.0f}", "train_tokens"),
        ("turns/trajectory", lambda r: f"{r['turns']:.2f}", None),
        *(
            (f"time share: {phase}", (lambda p: lambda r: f"{r['shares'][p]:.1%}")(phase), None)
            for phase in (*PHASES, "other")
        ),
    ]
    print(f"| {'figure':<28} | {'append':>8} | {'rerender':>8} | {'rerender/append':>15} |")
    print(f"|{'-' * 30}|{'-' * 10}|{'-' * 10}|{'-' * 17}|")
    for name, show, ratio_key in columns:
        ratio = "-"
        if ratio_key and results["append"][ratio_key]:
            ratio = f"{results['rerender'][ratio_key] / results['append'][ratio_key]:.2f}"
        print(f"| {name:<28} | {show(results['append']):>8} | {show(results['rerender']):>8} | {ratio:>15} |")
    print(
        "warm start: "
        + ", ".join(f"{c} {how}" for c, (_, how) in models.items())
        + "; RL seconds: "
        + ", ".join(f"{c} {r['rl_seconds']:.0f}" for c, r in results.items())
    )


if __name__ == "__main__":
    main()
