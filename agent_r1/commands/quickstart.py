"""``agent-r1 quickstart``: the embedded default, end to end on a CPU, nothing downloaded.

1. Build a ~1M-parameter Qwen2 and a byte-level tokenizer with a ChatML-with-tools template.
2. Generate the ``arithmetic`` task (``x*y+z`` with a one-operation calculator: two calls are needed)
   with disjoint train and held-out splits.
3. Supervised warm start on an imperfect demonstrator (on half the tasks it usually answers the
   product without the second call), each demonstration replayed through the same ``ToolEnv`` the RL
   uses, so the tokens are identical.
4. RL with the real trainer: multi-step rollouts through ``AgentEnvLoop`` + ``ToolEnv`` + ``HFEngine``,
   GRPO advantages, PPO-clip, dynamic filtering; held-out evaluation before and after. Sampling
   overlaps the update (``overlap_settings``; ``--sync`` takes turns).

Held-out success is measured the way the policy is trained and used: sampled at temperature 1,
``EVAL_SAMPLES`` episodes per task. Greedy decoding is not the measure here: the cloned model
answers prematurely ~35% of the time whatever the task (it does not learn within the warm start
which tasks its demonstrator slipped on), under greedy decoding's 50% threshold, so greedy success
is near 1.0 before RL already, while one in two or three sampled episodes fails.

Everything lands in ``--out``: ``sft_model/`` (the warm start), ``data/`` (train and held-out tasks as
JSONL), ``run/`` (config.yaml, metrics.jsonl, TensorBoard, trajectories, checkpoints) and
``summary.json`` (the before/after numbers). ``agent-r1 train OUT/run/config.yaml`` repeats
the RL part.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

HELP = (
    "Train a tiny local model to use a calculator: supervised warm start, then multi-step GRPO; "
    "prints held-out success before and after (CPU, minutes, no downloads)."
)

# The full default and the short CI run (--quick).
DEFAULTS = {"sft_demos": 800, "sft_epochs": 3, "rl_steps": 12, "eval_tasks": 100}
QUICK = {"sft_demos": 800, "sft_epochs": 3, "rl_steps": 6, "eval_tasks": 50}
EVAL_SAMPLES = 4  # sampled episodes per held-out task
# The most episodes sampled at once: the held-out evaluation's 400 run as one batch (16 s -> 13 s on
# the quickstart's warm start, 2 idle cores, against batches of 128), while a large --eval-tasks
# does not hold thousands of KV caches.
MAX_BATCH_ROWS = 512


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default="runs/quickstart", help="output folder (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="seed of data, model and sampling")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a short run (about half the default): for CI and a first look",
    )
    parser.add_argument("--sft-demos", type=int, help=f"demonstrations (default {DEFAULTS['sft_demos']})")
    parser.add_argument("--sft-epochs", type=int, help=f"passes over them (default {DEFAULTS['sft_epochs']})")
    parser.add_argument("--rl-steps", type=int, help=f"RL steps (default {DEFAULTS['rl_steps']})")
    parser.add_argument("--eval-tasks", type=int, help=f"held-out tasks (default {DEFAULTS['eval_tasks']})")
    parser.add_argument("--tasks-per-step", type=int, default=16, help="tasks per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="samples per task (GRPO group)")
    parser.add_argument("--lr", type=float, default=2e-4, help="RL learning rate")
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's choice for the warm start; half the cores for RL, "
        "torch's choice with --sync)",
    )
    parser.add_argument(
        "--sync",
        action="store_true",
        help="sample, then update, in turn (trainer.mode: sync); by default sampling overlaps the update",
    )


def _settings(args: argparse.Namespace) -> dict:
    base = QUICK if args.quick else DEFAULTS
    return {
        key: getattr(args, key) if getattr(args, key) is not None else value for key, value in base.items()
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def _eval_success(metrics_file: Path) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return [(row["step"], row["eval/success"]) for row in rows if "eval/success" in row]


def rl_settings(
    *,
    steps: int,
    tasks_per_step: int,
    group_size: int,
    lr: float,
    seed: int,
    run_dir: str,
    threads: int | None,
) -> dict:
    """What the quickstart's RL computes (rollout, algorithm, trainer sections), evaluating once
    before and once after training, sample and update in turn; ``benchmarks/multiturn.py`` and the
    races against TRL train with these settings. The quickstart itself adds ``overlap_settings``."""
    from agent_r1.tasks import get_task

    return {
        "rollout": {
            "n": group_size,
            "temperature": 1.0,
            "eval_temperature": 1.0,
            "eval_n": EVAL_SAMPLES,
            "max_tokens": 96,
            "max_steps": get_task("arithmetic").max_turns,
            "max_batch_size": tasks_per_step * group_size,
        },
        # The engine and the learner share one model: the sampler's log-probs are the learner's (to
        # ~1e-6), so they serve as the PPO ratio's old log-probs and no extra forward pass is run.
        "algorithm": {
            "advantage": "grpo",
            "policy_loss": "ppo_clip",
            "dynamic_filter": True,
            "old_logprobs": "sampler",
        },
        "trainer": {
            "steps": steps,
            "tasks_per_step": tasks_per_step,
            "mini_batches": 2,
            "lr": lr,
            "micro_batch_tokens": 16384,
            "seed": seed,
            "eval_every": steps,
            "run_dir": run_dir,
            "torch_threads": threads,
            "retain_freed_memory": True,
        },
    }


def overlap_settings(args: argparse.Namespace) -> dict:
    """How the quickstart's RL phase runs on this machine, beside ``rl_settings`` (what it computes).

    By default sampling overlaps the update (``trainer.mode: async``): step k+1's rollout runs on the
    engine's thread, from its own copy of the weights, while step k trains, one policy version
    behind, and the PPO ratio is taken against the sampler's log-probs (``old_logprobs: sampler``),
    which corrects for it. The two threads split the cores (``trainer.torch_threads``): with
    torch's choice each runs as many threads as there are cores and they preempt each other. On 2
    idle cores the 12 steps took 88 s in turn, 68 s overlapped with 2 threads each, 58 s with one
    each, for the same held-out gain (benchmarks/HISTORY.md).
    """
    if args.sync:
        return {}  # rl_settings as they are (torch_threads: --threads or torch's choice)
    threads = max(1, (os.cpu_count() or 2) // 2) if args.threads is None else args.threads
    return {
        "trainer": {"mode": "async", "max_staleness": 1, "torch_threads": threads},
        "rollout": {"share_model": False},
    }


def rl_config(args: argparse.Namespace, settings: dict, out: Path) -> dict:
    """The RL phase's whole config: ``rl_settings`` (what it computes) and ``overlap_settings`` (how it
    runs), over the warm start and the data in ``out``."""
    from agent_r1.tasks import get_task

    rl = rl_settings(
        steps=settings["rl_steps"],
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        seed=args.seed,
        run_dir=str(out / "run"),
        threads=args.threads,
    )
    overlap = overlap_settings(args)
    train_rows = rl["rollout"]["max_batch_size"]  # one step's rows
    eval_rows = settings["eval_tasks"] * EVAL_SAMPLES
    return {
        "rollout": {
            **rl["rollout"],
            **overlap.get("rollout", {}),
            "max_batch_size": max(train_rows, min(eval_rows, MAX_BATCH_ROWS)),
        },
        "algorithm": rl["algorithm"],
        "trainer": {**rl["trainer"], **overlap.get("trainer", {})},
        "model": {"path": str(out / "sft_model")},
        "data": {"train": str(out / "data" / "train.jsonl"), "val": str(out / "data" / "test.jsonl")},
        "env": {
            "name": "agent_r1.tasks.arithmetic:make_env",
            "kwargs": {"max_turns": get_task("arithmetic").max_turns},
        },
        "logging": {"progress": True, "tensorboard": True, "dump_trajectories": True},
    }


def run(args: argparse.Namespace) -> int:
    from agent_r1.models.loading import save_model
    from agent_r1.models.tiny import build_tiny
    from agent_r1.tasks import arithmetic, get_task
    from agent_r1.train.config import config_from_dict
    from agent_r1.train.process import retain_freed_memory, set_torch_threads
    from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
    from agent_r1.train.trainer import Trainer

    settings = _settings(args)
    out = Path(args.out)
    if args.threads:
        set_torch_threads(args.threads)
    retain_freed_memory()  # the warm start too (the RL trainer's config asks for it as well)
    started = time.perf_counter()
    spec = get_task("arithmetic")
    model, tokenizer = build_tiny(seed=args.seed)
    rl_tasks = spec.make_dataset(settings["rl_steps"] * args.tasks_per_step, split="train", seed=args.seed)
    heldout = spec.make_dataset(settings["eval_tasks"], split="test", seed=args.seed)
    _write_jsonl(out / "data" / "train.jsonl", rl_tasks)
    _write_jsonl(out / "data" / "test.jsonl", heldout)

    print(f"[1/3] supervised warm start on {settings['sft_demos']} imperfect demonstrations", flush=True)
    demo_tasks = spec.make_dataset(settings["sft_demos"], split="train", seed=args.seed + 1)
    demos = replay_demonstrations(
        lambda: arithmetic.make_env(tokenizer), tokenizer, demo_tasks, spec.demonstrate, seed=args.seed
    )
    demo_success = sum(t.outcome_reward for t in demos) / len(demos)
    sft_config = SFTConfig(epochs=settings["sft_epochs"], batch_size=16, micro_batch_size=16, seed=args.seed)
    total_steps = sft_config.epochs * (len(demos) // sft_config.batch_size)

    def log(step: int, loss: float) -> None:
        if step % max(1, total_steps // 10) == 0:
            print(f"      SFT step {step}/{total_steps}: loss {loss:.3f}", flush=True)

    losses = train_sft(model, sft_sequences(demos), sft_config, pad_token_id=tokenizer.pad_token_id, log=log)
    sft_dir = out / "sft_model"
    save_model(model, tokenizer, sft_dir)
    sft_seconds = time.perf_counter() - started
    print(
        f"      demonstrator success {demo_success:.2f}; SFT loss {losses[0]:.3f} -> {losses[-1]:.3f} "
        f"({sft_seconds:.0f}s)",
        flush=True,
    )

    print(
        f"[2/3] RL: {settings['rl_steps']} GRPO steps of {args.tasks_per_step} tasks x {args.group_size}"
        + ("" if args.sync else " (sampling overlaps the update)"),
        flush=True,
    )
    config = config_from_dict(rl_config(args, settings, out))
    rl_started = time.perf_counter()
    # OUT is rebuilt from scratch (data, warm start): an earlier quickstart's run there is replaced.
    Trainer(config, tokenizer=tokenizer, model=model, overwrite=True).fit()
    rl_seconds = time.perf_counter() - rl_started

    evals = _eval_success(out / "run" / "metrics.jsonl")
    before, after = evals[0][1], evals[-1][1]
    summary = {
        "heldout_success_sft": before,
        "heldout_success_rl": after,
        "gain_points": round(100 * (after - before), 1),
        "demonstrator_success": demo_success,
        "sft_seconds": round(sft_seconds, 1),
        "rl_seconds": round(rl_seconds, 1),
        "total_seconds": round(time.perf_counter() - started, 1),
        "settings": {
            **settings,
            "eval_samples": EVAL_SAMPLES,
            "tasks_per_step": args.tasks_per_step,
            "group_size": args.group_size,
            "mode": config.trainer.mode,
            "torch_threads": config.trainer.torch_threads,
        },
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(
        f"[3/3] held-out success ({len(heldout)} tasks x {EVAL_SAMPLES} sampled): after SFT {before:.3f} -> after RL {after:.3f} "
        f"({summary['gain_points']:+.1f} points); total {summary['total_seconds']:.0f}s. Run folder: {out / 'run'}",
        flush=True,
    )
    return 0
