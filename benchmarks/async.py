"""Synchronous vs asynchronous training at a fixed wall-clock budget, side by side in one run.

Arms (the same task, warm start, seed, algorithm and settings; only how rollout and update are
scheduled differs):

- ``sync``: roll out, then update, with the engine sharing the learner's model (the default), at
  ``--sync-threads`` torch threads (default 2: both cores on one phase at a time) and at 1 thread;
- ``async``: ``trainer.mode: async`` in one process (``rollout.share_model: false``: the HF engine
  samples from its own copy on a rollout thread; partial rollouts), at 1 torch thread, so that the
  rollout and the update each get a core (they still share one Python interpreter lock);
- ``async-ray``: the same loop on Ray on this machine: one rollout actor and one learner worker, each
  a process of its own at 1 torch thread (weights through the object store after every update).

Tasks:

- ``quickstart``: the quickstart's two-call calculator task (``agent_r1/commands/quickstart.py``),
  its SFT warm start and RL settings (GRPO, PPO-clip on the sampler's log-probs, dynamic filter);
- ``longtail``: a token-level task whose episodes last 1-8 turns, drawn with P(k) ~ 1/k (a long tail
  of turn counts: a rollout lasts as long as its longest episode); each response earns the fraction
  of its tokens in the lower half of the byte vocabulary; success = mean reward > 0.75. The tiny
  model starts from random weights (about 0.5).

For each (task, arm): held-out success before and after (``--eval-tasks`` tasks, sampled, with its
standard error), RL steps finished in ``--minutes`` of wall clock and steps per minute, sampled tokens
per second, staleness (mean and max policy versions a trained step lagged), the fraction of update
time a rollout ran beside it (``agent_r1.report.html.overlap_fraction``), and each phase's time.
Ratios are against the faster sync arm, measured in the same run. Only ratios inside one run are
meaningful on a shared machine.

    python benchmarks/async.py                  # both tasks, 2 minutes of RL per arm
    python benchmarks/async.py --task longtail --minutes 4
    python benchmarks/async.py --quick          # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch
from multiturn import (  # a sibling script (its folder is on sys.path)
    budgeted_settings,
    make_env,
    train_for,
    warm_starts,
)

from agent_r1.commands import quickstart
from agent_r1.envs.base import AgentEnv
from agent_r1.models.loading import save_model
from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.report.html import overlap_fraction, phase_timeline
from agent_r1.tasks import get_task
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer
from agent_r1.types import Action, Observation, StepResult

ARMS = {
    # name: (trainer.mode, torch threads or None for --sync-threads, distributed.backend)
    "sync": ("sync", None, "none"),
    "sync-1t": ("sync", 1, "none"),
    "async": ("async", 1, "none"),
    "async-ray": ("async", 1, "ray"),
    "sync-ray": ("sync", 1, "ray"),  # not run by default: the Ray baseline of async-ray
}
DEFAULT_ARMS = ("sync", "sync-1t", "async", "async-ray")
BENCHMARKS = Path(__file__).resolve().parent
TASKS = ("quickstart", "longtail")


class LongTailEnv(AgentEnv):
    """``task["turns"]`` turns; each response earns the fraction of its tokens below id 128."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def reset(self, task):
        self.turns, self.turn, self.rewards = int(task["turns"]), 0, []
        self.ids = self._encode(f"<|im_start|>user\n{task['prompt']}<|im_end|>\n<|im_start|>assistant\n")
        return Observation(token_ids=self.ids)

    async def step(self, action: Action) -> StepResult:
        self.turn += 1
        reward = sum(1 for t in action.token_ids if t < 128) / max(len(action.token_ids), 1)
        self.rewards.append(reward)
        done = self.turn >= self.turns
        self.ids = (
            self.ids
            + list(action.token_ids)
            + self._encode("\n<|im_start|>user\nmore<|im_end|>\n<|im_start|>assistant\n")
        )
        mean = sum(self.rewards) / len(self.rewards)
        return StepResult(
            observation=None if done else Observation(token_ids=self.ids),
            reward=0.0,
            outcome_reward=mean if done else None,
            terminated=done,
            info={"success": mean > 0.75} if done else {},
        )


def longtail_tasks(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    weights = [1 / k for k in range(1, 9)]
    return [
        {"id": f"lt{seed}-{i}", "prompt": f"task {i}", "turns": rng.choices(range(1, 9), weights)[0]}
        for i in range(n)
    ]


def arm_config(task: str, arm: str, threads: int, args, run_dir: Path, model_path: Path | None):
    mode, _, backend = ARMS[arm]
    settings = budgeted_settings(args, run_dir, threads)
    if task == "longtail":
        settings["rollout"].update(max_tokens=12, max_steps=8)
        settings["trainer"]["lr"] = 3e-3
    if mode == "async":
        settings["trainer"]["mode"] = "async"
        settings["rollout"]["share_model"] = False
    if backend == "ray":  # the actors build model, engine and env from the config
        settings["model"] = {"path": str(model_path)}
        settings["distributed"] = {"backend": "ray", "num_rollout_actors": 1, "num_learner_workers": 1}
        settings["env"] = (
            {"name": "agent_r1.tasks.prepare:task_env", "kwargs": {"task": "arithmetic"}}
            if task == "quickstart"
            else {"name": "async:LongTailEnv"}
        )
    return config_from_dict(settings)


def run_arm(task: str, arm: str, tokenizer, model, args, out: Path) -> dict:
    _, threads, backend = ARMS[arm]
    threads = threads or args.sync_threads
    torch.set_num_threads(threads)
    if task == "quickstart":
        spec = get_task("arithmetic")
        train_tasks = spec.make_dataset(4000, split="train", seed=args.seed)
        heldout = spec.make_dataset(args.eval_tasks, split="test", seed=args.seed)

        def env_factory():
            return make_env(tokenizer, "append")
    else:
        train_tasks = longtail_tasks(4000, args.seed)
        heldout = longtail_tasks(args.eval_tasks, args.seed + 1)

        def env_factory():
            return LongTailEnv(tokenizer)

    if backend == "ray":
        from agent_r1.distributed import actor_runtime_env

        model_path = out / f"{task}-model"
        if not model_path.exists():
            save_model(model, tokenizer, model_path)
        config = arm_config(task, arm, threads, args, out / f"{task}-{arm}", model_path)
        trainer = Trainer(
            config,
            train_tasks=train_tasks,
            val_tasks=heldout,
            runtime_env=actor_runtime_env([str(BENCHMARKS)]),
        )
    else:
        trainer = Trainer(
            arm_config(task, arm, threads, args, out / f"{task}-{arm}", None),
            tokenizer=tokenizer,
            model=copy.deepcopy(model),
            env_factory=env_factory,
            train_tasks=train_tasks,
            val_tasks=heldout,
        )
    try:
        before = trainer.evaluate()["eval/success"]
        started = time.perf_counter()
        rows = train_for(trainer, args.minutes * 60, out / f"{task}-{arm}")
        seconds = time.perf_counter() - started
        after = trainer.evaluate()["eval/success"]
    finally:
        trainer.close()
    sampled = sum(r["throughput/tokens_per_s"] * r["time/step"] for r in rows)
    samples = args.eval_tasks * quickstart.EVAL_SAMPLES
    overlap = overlap_fraction(phase_timeline([{**r, "step": i + 1} for i, r in enumerate(rows)]))
    phases = ("rollout", "reference", "update", "sync")
    return {
        "threads": threads,
        "before": before,
        "after": after,
        "se": math.sqrt(max(after * (1 - after), 1e-12) / samples),
        "steps": len(rows),
        "steps_per_min": len(rows) / (seconds / 60),
        "tokens_per_s": sampled / seconds,
        "staleness_mean": sum(r.get("async/staleness_mean", 0.0) for r in rows) / len(rows),
        "staleness_max": max(r.get("async/staleness_max", 0.0) for r in rows),
        "overlap": overlap or 0.0,
        "phase_seconds": {p: sum(r.get(f"time/{p}", 0.0) for r in rows) / len(rows) for p in phases},
    }


def progress(message: str) -> None:
    print(f"[async {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _phase_cell(phase: str):
    return lambda r: f"{r['phase_seconds'][phase]:.2f}"


def print_table(task: str, results: dict[str, dict]) -> None:
    syncs = [a for a in results if ARMS[a][0] == "sync"] or list(results)  # no sync arm: the first arm
    base = max(syncs, key=lambda a: results[a]["steps_per_min"])
    print(f"\n## {task} (ratios against the faster sync arm, '{base}')")
    columns = [
        ("torch threads", lambda r: f"{r['threads']}", None),
        ("held-out success before", lambda r: f"{r['before']:.3f}", None),
        ("held-out success after (±SE)", lambda r: f"{r['after']:.3f}±{r['se']:.3f}", None),
        ("RL steps in budget", lambda r: f"{r['steps']}", None),
        ("steps / min", lambda r: f"{r['steps_per_min']:.2f}", "steps_per_min"),
        ("sampled tokens / s", lambda r: f"{r['tokens_per_s']:.0f}", "tokens_per_s"),
        ("staleness mean / max", lambda r: f"{r['staleness_mean']:.2f}/{r['staleness_max']:.0f}", None),
        ("update time beside a rollout", lambda r: f"{r['overlap']:.0%}", None),
        *(
            (f"s/step in {phase}", _phase_cell(phase), None)
            for phase in ("rollout", "reference", "update", "sync")
        ),
    ]
    arms = list(results)
    print("| figure | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for name, show, ratio_key in columns:
        cells = []
        for arm in arms:
            cell = show(results[arm])
            if ratio_key and arm != base and results[base][ratio_key]:
                cell += f" ({results[arm][ratio_key] / results[base][ratio_key]:.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--task", choices=(*TASKS, "both"), default="both")
    parser.add_argument(
        "--arms", default=",".join(DEFAULT_ARMS), help=f"comma-separated, of {', '.join(ARMS)}"
    )
    parser.add_argument("--minutes", type=float, default=2.0, help="wall-clock RL budget per arm")
    parser.add_argument("--sync-threads", type=int, default=2, help="torch threads of the 'sync' arm")
    parser.add_argument("--sft-demos", type=int, default=quickstart.DEFAULTS["sft_demos"])
    parser.add_argument("--sft-epochs", type=int, default=quickstart.DEFAULTS["sft_epochs"])
    parser.add_argument("--eval-tasks", type=int, default=quickstart.DEFAULTS["eval_tasks"])
    parser.add_argument("--tasks-per-step", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.sft_demos, args.sft_epochs, args.eval_tasks = 0.1, 64, 1, 8
        args.tasks_per_step, args.group_size = 4, 2
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    tasks = TASKS if args.task == "both" else (args.task,)

    tokenizer = build_tiny_tokenizer()
    models = {}
    if "quickstart" in tasks:
        progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
        models["quickstart"] = warm_starts(tokenizer, args, ("append",))["append"][0]
    if "longtail" in tasks:
        models["longtail"] = build_tiny_model(
            len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=args.seed,
        )
    results: dict[str, dict[str, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="async_") as tmp:
        for task in tasks:
            results[task] = {}
            for arm in arms:
                progress(f"{task}: {arm} for {args.minutes:g} min")
                results[task][arm] = run_arm(task, arm, tokenizer, models[task], args, Path(tmp))

    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"load average at the end {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}"
    )
    print(
        f"budget {args.minutes:g} min of RL per arm; {args.tasks_per_step} tasks x {args.group_size} samples "
        f"per step; held-out success on {args.eval_tasks} tasks x {quickstart.EVAL_SAMPLES} sampled episodes"
    )
    for task in tasks:
        print_table(task, results[task])


if __name__ == "__main__":
    main()
