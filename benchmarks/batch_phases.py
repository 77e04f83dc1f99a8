"""The trainer's non-model phases on the quickstart batch: building the step's batch, the advantages,
and the update's bookkeeping (mini-batches, masks, aggregation weights, packing), without any forward
or backward pass.

The batch is the quickstart's (16 tasks x 8 samples of the multi-turn calculator task, 2 mini-batches,
micro-batches of 16,384 tokens, sampler log-probs as the old ones), made of the task's scripted
demonstrations replayed through the real environment (the same trajectories every run, no sampling).
The learner is a test double (``NoModelLearner``) whose update returns at once, so what is timed is
the trainer's own work.

Compare two versions of the trainer by running this script against each in one sitting:

    python benchmarks/batch_phases.py                         # the checkout's agent_r1
    PYTHONPATH=/path/to/other/checkout python benchmarks/batch_phases.py
    python benchmarks/batch_phases.py --quick                 # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import statistics
import tempfile
import time

import torch

import agent_r1
from agent_r1.commands.quickstart import rl_settings
from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.tasks import arithmetic, get_task
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.train.trainer import Trainer
from agent_r1.types import TrajectoryGroup


class NoModelLearner:
    """Test double for the learner backend: an update that returns at once (no forward/backward)."""

    has_critic = False

    def __init__(self, real) -> None:
        self.real = real

    def update(self, mini_batch, objective, *, with_entropy: bool = False) -> dict[str, float]:
        return {"loss/policy": 0.0, "update/skipped": 0.0}

    def close(self) -> None:
        self.real.close()


def quickstart_groups(tokenizer, tasks_per_step: int, group_size: int, seed: int) -> list[TrajectoryGroup]:
    spec = get_task("arithmetic")
    tasks = spec.make_dataset(tasks_per_step, split="train", seed=seed)
    groups = []
    for i, task in enumerate(tasks):
        demos = replay_demonstrations(
            lambda: arithmetic.make_env(tokenizer),
            tokenizer,
            [task] * group_size,
            spec.demonstrate,
            seed=seed + i,
        )
        groups.append(TrajectoryGroup(f"g{i}", demos[0].task_id, tuple(demos)))
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 15)
    tasks_per_step, group_size = (4, 4) if args.quick else (16, 8)
    torch.manual_seed(args.seed)
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}; agent_r1 from "
        f"{os.path.dirname(agent_r1.__file__)}"
    )
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(
        len(tokenizer), eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    groups = quickstart_groups(tokenizer, tasks_per_step, group_size, args.seed)
    with tempfile.TemporaryDirectory() as run_dir:
        settings = rl_settings(
            steps=1,
            tasks_per_step=tasks_per_step,
            group_size=group_size,
            lr=1e-4,
            seed=args.seed,
            run_dir=run_dir,
            threads=None,
        )
        config = config_from_dict(
            {
                **settings,
                "env": {"name": "agent_r1.tasks.arithmetic:make_env"},
                "logging": {"progress": False},
            }
        )
        trainer = Trainer(config, tokenizer=tokenizer, model=model, train_tasks=arithmetic.make_dataset(1))
        trainer.learner = NoModelLearner(trainer.learner)
        seconds: dict[str, list[float]] = {"prepare": [], "advantage": [], "update": []}
        for _ in range(repeats):
            start = time.perf_counter()
            if hasattr(trainer, "prepare"):  # an older trainer: one prepare, advantages apart
                batch = trainer.prepare(groups, 1)
                prepared = time.perf_counter()
                advantages = trainer.advantages(batch)
                estimated = time.perf_counter()
                trainer.update(batch, advantages, 1)
            elif not hasattr(trainer, "context"):  # the batch phases as trainer methods
                batch, _ = trainer.old_logprobs(trainer.batch(groups, 1))
                batch = trainer.values(trainer.reference(batch))
                prepared = time.perf_counter()
                batch = trainer.advantages(batch)
                estimated = time.perf_counter()
                trainer.update(batch, 1)
            else:  # the learning phases as units (agent_r1.train.phases)
                phases = dict(importlib.import_module("agent_r1.train.phases").LEARNING_PHASES)
                context = trainer.context(1)
                batch = trainer.batch(groups, 1)
                for name in ("old_logprobs", "reference", "values"):
                    batch, _ = phases[name](batch, context)
                prepared = time.perf_counter()
                batch, _ = phases["advantage"](batch, context)
                estimated = time.perf_counter()
                phases["update"](batch, context)
            updated = time.perf_counter()
            seconds["prepare"].append(prepared - start)
            seconds["advantage"].append(estimated - prepared)
            seconds["update"].append(updated - estimated)
        trainer.close()
    steps = sum(len(t.steps) for g in groups for t in g.trajectories)
    tokens = sum(len(s.response_ids) for g in groups for t in g.trajectories for s in t.steps)
    print(
        f"batch: {len(groups)} groups x {group_size}, {steps} steps, {tokens} response tokens; median of {repeats}"
    )
    print(f"{'phase':<12} {'ms':>10}")
    total = 0.0
    for phase, values in seconds.items():
        median = statistics.median(values) * 1e3
        total += median
        print(f"{phase:<12} {median:>10.1f}")
    print(f"{'total':<12} {total:>10.1f}")


if __name__ == "__main__":
    main()
