"""Context policies on a long-horizon task: append vs sliding_window vs trained summarize, at equal wall-clock.

The task is ``gridwalk_memory`` (``agent_r1/tasks/gridwalk_memory.py``): gridwalk's 6-10 moves with
the only reward at the end, but the goal is told once, in an opening look, and each move is
answered only with what is left on its axis (``moved E, 2E left``), so the context grows and the
offset left on the other axis lies in an older turn. Arms (the context policy of the env;
everything else equal):

- ``append``: the whole history, token-level append (one training sequence per trajectory);
- ``sliding_window``: the head (the system prompt) and the last ``--window`` turns: the goal is
  dropped once ``--window`` moves are made;
- ``summarize``: once more than ``--summary-max-turns`` turns pile up, all but the last
  ``--summary-keep`` are replaced by a summary the policy writes, trained as a step of its own
  (``StepResult.policy_steps``) with the episode's outcome credit (GRPO).

Warm start, the same budget for every arm: one demonstrator (``--demonstrator``: ``axis``, the
default, ``gridwalk_memory.demonstrate_axis_by_axis``: one axis of the goal, then the other;
``interleaved``, ``gridwalk.demonstrate`` without sidesteps: a random useful axis each move; both
always toward the goal), the same
``--sft-demos`` tasks and moves, the same ``--sft-epochs`` and ``--sft-batch``, each demonstration
rendered through the arm's own context policy; for ``summarize`` the demonstrator also writes every
summary, correctly (the offset left, ``gridwalk_memory.demonstrated_summary``). The layouts differ
(an ``append`` demonstration is one training sequence, a windowed or summarised one several), so the
batch counts demonstrations (``--sft-batch``): every arm gets the same optimizer steps, each on the
sequences of the same number of demonstrations (``warm_start`` in the JSON: ``sft_steps``,
``sft_batch_sequences``). Counted in sequences, the windowed arm would get ~6x the optimizer
steps of ``append`` from the same demonstrations. Then RL (the real ``Trainer``: ``AgentEnvLoop``
rollouts, GRPO advantages, PPO-clip) for ``--minutes`` of wall-clock per arm and seed (the clock
stops at the first step that ends past it; evaluations are outside it). Held-out success (24 test
offsets x ``--eval-n`` samples, T=1) after the warm start and after RL.

Per arm, over seeds: held-out success after warm start and after RL (mean, min-max), RL steps in the
budget, and per RL step: trained tokens (``train/tokens``: after prefix merging), sampled response
tokens, prompt tokens (every step's prompt, summary requests included), summary steps per
trajectory, summary accuracy (the share of sampled summaries equal to ``demonstrated_summary`` of
the request they answer, i.e. right given what they were shown), wall seconds and CPU seconds
(``time.process_time``: the machine may be shared).

Writes ``OUT/results.json`` and prints the machine and one table.

    python benchmarks/context.py             # 3 arms x 2 seeds x 2 min of RL, ~22 min on 2 shared cores
    python benchmarks/context.py --quick     # a smoke run (the test suite's)
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from credit import config_for, fmt, sampled_tokens, warm_start
from multiturn import own_step_loop

from agent_r1.envs.context import SUMMARY_STEP_KEY
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.tasks import gridwalk
from agent_r1.tasks.gridwalk_memory import (
    GridMemoryEnv,
    demonstrate_axis_by_axis,
    demonstrated_summary,
    demonstrator_policy,
)
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import Trajectory, read_jsonl

ARMS = ("append", "sliding_window", "summarize")
DEMONSTRATORS = {
    "axis": demonstrate_axis_by_axis,
    "interleaved": functools.partial(gridwalk.demonstrate, error_rate=0.0),
}
MAX_TOKENS = 12  # the longest summary, "Goal 8E 8N", and its end-of-turn token, with room to spare


def context_kwargs(arm: str, args) -> dict:
    if arm == "sliding_window":
        return {"k": args.window}
    if arm == "summarize":
        return {"max_turns": args.summary_max_turns, "keep_last": args.summary_keep}
    return {}


class ArmEnv:
    """The arm's env factory: a fresh ``GridMemoryEnv`` with the arm's context policy. With
    ``demonstrator`` the env is lent ``demonstrator_policy``, which writes the summaries of a
    replayed demonstration."""

    def __init__(self, arm: str, args, *, demonstrator: bool = False) -> None:
        self.arm, self.kwargs, self.demonstrator = arm, context_kwargs(arm, args), demonstrator
        self.tokenizer = build_tiny_tokenizer()

    def __call__(self) -> GridMemoryEnv:
        env = GridMemoryEnv(self.tokenizer, context=self.arm, context_kwargs=self.kwargs)
        if self.demonstrator:
            env.lend_policy(demonstrator_policy(self.tokenizer))
        return env


def step_costs(trajectories: list[Trajectory], tokenizer) -> dict:
    """Prompt tokens, summary steps and right summaries of one training step's trajectories."""
    steps = [s for t in trajectories for s in t.steps]
    summaries = [s for s in steps if SUMMARY_STEP_KEY in s.info]
    right = 0
    for summary in summaries:
        request = tokenizer.decode(list(summary.prompt_ids), skip_special_tokens=False)
        written = summary.response_text.removesuffix(tokenizer.eos_token).strip()
        right += written == demonstrated_summary(request)
    return {
        "prompt_tokens": sum(len(s.prompt_ids) for s in steps),
        "summaries": len(summaries),
        "right_summaries": right,
        "trajectories": len(trajectories),
    }


def run_arm(arm: str, seed: int, warm, tokenizer, model_path: str, args, tmp: Path) -> dict:
    """Held-out success after the warm start, RL for ``--minutes`` of wall-clock, success again."""
    run_dir = tmp / f"{arm}-{seed}"
    config = config_for("grpo", args, seed, run_dir, model_path)
    config["rollout"]["max_tokens"] = MAX_TOKENS
    trainer = Trainer(
        config_from_dict(config),
        tokenizer=tokenizer,
        model=copy.deepcopy(warm),
        env_factory=ArmEnv(arm, args),
        train_tasks=gridwalk.make_dataset(4000, split="train", seed=seed),
        val_tasks=gridwalk.make_dataset(split="test"),
    )
    own_step_loop(trainer, run_dir)
    per_step: list[dict] = []
    try:
        before = trainer.evaluate()["eval/success"]
        budget_s, wall_s, cpu_s = args.minutes * 60, 0.0, 0.0
        while wall_s < budget_s:
            step = len(per_step) + 1
            trainer.step = step
            wall, cpu = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(step)
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            wall_s, cpu_s = wall_s + wall, cpu_s + cpu
            dumped = list(read_jsonl(run_dir / "trajectories" / f"step_{step:06d}.jsonl"))
            per_step.append(
                {
                    "seconds": wall,
                    "cpu_seconds": cpu,
                    "trained_tokens": metrics["train/tokens"],
                    "sampled_tokens": sampled_tokens(metrics),
                    "success": metrics["success/mean"],
                    **step_costs(dumped, tokenizer),
                }
            )
        after = trainer.evaluate()["eval/success"]
    finally:
        trainer.run_dir.close()
        trainer.close()
    return {"before": before, "after": after, "wall_s": wall_s, "cpu_s": cpu_s, "per_step": per_step}


def arm_row(runs: list[dict]) -> dict:
    """One arm's table row over its seeds: success means and min-max, per-step means."""
    steps = [s for r in runs for s in r["per_step"]]

    def per_step(key: str) -> float:
        return statistics.fmean(s[key] for s in steps)

    summaries = sum(s["summaries"] for s in steps)
    return {
        "before": statistics.fmean(r["before"] for r in runs),
        "before_min": min(r["before"] for r in runs),
        "before_max": max(r["before"] for r in runs),
        "after": statistics.fmean(r["after"] for r in runs),
        "after_min": min(r["after"] for r in runs),
        "after_max": max(r["after"] for r in runs),
        "steps": statistics.fmean(len(r["per_step"]) for r in runs),
        "trained_tokens": per_step("trained_tokens"),
        "sampled_tokens": per_step("sampled_tokens"),
        "prompt_tokens": per_step("prompt_tokens"),
        "summaries_per_trajectory": summaries / sum(s["trajectories"] for s in steps),
        "summary_accuracy": sum(s["right_summaries"] for s in steps) / summaries if summaries else None,
        "s_per_step": per_step("seconds"),
        "cpu_s_per_step": per_step("cpu_seconds"),
    }


def progress(message: str) -> None:
    print(f"[context {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/context", help="output folder (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1], help="RL seeds")
    parser.add_argument("--minutes", type=float, default=2.0, help="RL wall-clock per arm and seed")
    parser.add_argument("--window", type=int, default=2, help="sliding_window: turns kept")
    parser.add_argument("--summary-max-turns", type=int, default=3, help="summarize: turns before a summary")
    parser.add_argument("--summary-keep", type=int, default=1, help="summarize: turns kept after one")
    parser.add_argument("--sft-demos", type=int, default=400, help="warm-start demonstrations per arm")
    parser.add_argument("--sft-epochs", type=int, default=4)
    parser.add_argument(
        "--sft-batch", type=int, default=8, help="warm-start demonstrations per optimizer step"
    )
    parser.add_argument(
        "--demonstrator",
        choices=sorted(DEMONSTRATORS),
        default="axis",
        help="axis: one axis of the goal, then the other (default); interleaved: gridwalk's, "
        "a random useful axis each move",
    )
    parser.add_argument("--eval-n", type=int, default=8, help="samples per held-out task (24 tasks)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--gamma", type=float, default=1.0, help="discount over steps")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.minutes = [0], 0.05
        args.sft_demos, args.sft_epochs, args.eval_n = 32, 1, 1
        args.tasks_per_step, args.group_size = 2, 2

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"settings": dict(vars(args)), "warm_start": {}, "runs": {arm: {} for arm in ARMS}}
    with tempfile.TemporaryDirectory(prefix="context_") as tmp_name:
        tmp = Path(tmp_name)
        for arm in ARMS:
            progress(f"{arm}: warm start, {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
            model_path = tmp / f"warm_{arm}"
            warm, tokenizer, results["warm_start"][arm] = warm_start(
                args,
                model_path,
                ArmEnv(arm, args, demonstrator=True),
                DEMONSTRATORS[args.demonstrator],
                batch_size=args.sft_batch,
                per_demonstration=True,
            )
            for seed in args.seeds:
                progress(f"{arm}: seed {seed}, RL for {args.minutes:g} min")
                run = run_arm(arm, seed, warm, tokenizer, str(model_path), args, tmp)
                results["runs"][arm][str(seed)] = run
                (out / "results.json").write_text(
                    json.dumps(results, indent=1)
                )  # a crash keeps the runs done
    results["wall_seconds"] = time.perf_counter() - started
    table = {
        arm: {
            **arm_row(list(results["runs"][arm].values())),
            "sft_steps": results["warm_start"][arm]["sft_steps"],
        }
        for arm in ARMS
    }
    results["table"] = table
    (out / "results.json").write_text(json.dumps(results, indent=1))

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}"
    )
    print(
        f"task: gridwalk_memory (6-8 cells, budget +{gridwalk.DEFAULT_SLACK}, goal told once); warm start "
        f"{args.sft_demos} demos x {args.sft_epochs} epochs per arm (demonstrator success "
        f"{results['warm_start']['append']['demonstrator_success']:.3f}); RL {args.minutes:g} min per arm "
        f"and seed, {args.tasks_per_step} tasks x {args.group_size} samples per step, lr {args.lr:g}; "
        f"held-out {len(gridwalk.split_offsets('test'))} tasks x {args.eval_n}; seeds {args.seeds}; "
        f"window k={args.window}; summarize max_turns={args.summary_max_turns} keep_last={args.summary_keep}"
    )
    columns = [
        ("success warm", lambda r: f"{r['before']:.3f}"),
        ("warm min-max", lambda r: f"{r['before_min']:.3f}-{r['before_max']:.3f}"),
        ("success RL", lambda r: f"{r['after']:.3f}"),
        ("RL min-max", lambda r: f"{r['after_min']:.3f}-{r['after_max']:.3f}"),
        ("RL steps", lambda r: f"{r['steps']:.1f}"),
        ("trained tok/step", lambda r: f"{r['trained_tokens']:.0f}"),
        ("sampled tok/step", lambda r: f"{r['sampled_tokens']:.0f}"),
        ("prompt tok/step", lambda r: f"{r['prompt_tokens']:.0f}"),
        ("summaries/traj", lambda r: f"{r['summaries_per_trajectory']:.2f}"),
        ("summary acc.", lambda r: fmt(r["summary_accuracy"])),
        ("s/step", lambda r: f"{r['s_per_step']:.2f}"),
        ("CPU s/step", lambda r: f"{r['cpu_s_per_step']:.2f}"),
        ("warm-start opt. steps", lambda r: f"{r['sft_steps']}"),
    ]
    print("| arm | " + " | ".join(name for name, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for arm in ARMS:
        print(f"| {arm} | " + " | ".join(show(table[arm]) for _, show in columns) + " |")
    print(f"wrote {out / 'results.json'}; {results['wall_seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
