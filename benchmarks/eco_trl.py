"""Ecosystem arm: the quickstart task written as a TRL environment class, trained through
``env.name: trl_environment``; held-out success before and after RL.

The class and the reward function are TRL's side of the multi-turn race, unchanged
(``benchmarks/vs_trl_multiturn.py``: ``CalculatorEnvironment``, whose ``calculator`` method is the
tool, and ``trl_success``, a reward function in TRL's signature that reads ``environments``); they
go to ``TRLEnvironment`` as ``GRPOTrainer(environment_factory=..., reward_funcs=...)`` would take
them. The format is the quickstart's (``SystemPromptHermes``: the task's system prompt describes the
calculator), so every token equals the quickstart's ``ArithmeticEnv``'s (tests/test_ecosystem_trl.py
checks this on replayed episodes).

Pipeline: the quickstart's (``agent_r1/commands/quickstart.py``): the tiny model, supervised warm
start on the imperfect demonstrator (it often answers the product without the second call), each
demonstration replayed through this adapter; then RL with the quickstart's settings; held-out success
evaluated by the trainer before the first step and after the last (``quickstart.EVAL_SAMPLES``
episodes per task, sampled at temperature 1).

    python benchmarks/eco_trl.py           # the quickstart's sizes (about 5 min on 2 idle cores)
    python benchmarks/eco_trl.py --quick   # a smoke run (under a minute)
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from run_digest import digest
from vs_trl_multiturn import CalculatorEnvironment, trl_success

from agent_r1.commands import quickstart
from agent_r1.envs.ecosystem.trl import TRLEnvironment
from agent_r1.models.tiny import build_tiny
from agent_r1.tasks import get_task
from agent_r1.tasks.arithmetic import SystemPromptHermes
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer

FULL = {**quickstart.DEFAULTS, "tasks_per_step": 16, "group_size": 8}
QUICK = {
    "sft_demos": 48,
    "sft_epochs": 1,
    "rl_steps": 2,
    "eval_tasks": 4,
    "tasks_per_step": 2,
    "group_size": 4,
}


def run(seed: int = 0, quick: bool = False) -> dict:
    """Warm start, then RL on the quickstart task through the TRL-class adapter."""
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    spec = get_task("arithmetic")
    torch.manual_seed(seed)
    model, tokenizer = build_tiny(seed=seed)
    tally: Counter = Counter()

    def make_env() -> TRLEnvironment:
        return TRLEnvironment(
            tokenizer,
            CalculatorEnvironment,
            reward=trl_success(tally),
            format=SystemPromptHermes(),
            max_turns=spec.max_turns,
        )

    demo_tasks = spec.make_dataset(settings["sft_demos"], split="train", seed=seed + 1)
    demos = replay_demonstrations(make_env, tokenizer, demo_tasks, spec.demonstrate, seed=seed)
    sft = SFTConfig(epochs=settings["sft_epochs"], batch_size=16, micro_batch_size=16, seed=seed)
    train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
    rl_tasks = spec.make_dataset(settings["rl_steps"] * settings["tasks_per_step"], split="train", seed=seed)
    heldout = spec.make_dataset(settings["eval_tasks"], split="test", seed=seed)
    with tempfile.TemporaryDirectory(prefix="eco_trl_") as tmp:
        rl = quickstart.rl_settings(
            steps=settings["rl_steps"],
            tasks_per_step=settings["tasks_per_step"],
            group_size=settings["group_size"],
            lr=2e-4,
            seed=seed,
            run_dir=tmp,
            threads=None,
        )
        config = config_from_dict(
            {
                **rl,
                "model": {"path": ""},
                "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
            }
        )
        trainer = Trainer(
            config,
            tokenizer=tokenizer,
            model=model,
            env_factory=make_env,
            train_tasks=rl_tasks,
            val_tasks=heldout,
        )
        try:
            trainer.fit()
        finally:
            trainer.close()
        rows = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        measured = digest(tmp)
    evals = [row["eval/success"] for row in rows if "eval/success" in row]
    return {
        "env": "trl_environment: vs_trl_multiturn.CalculatorEnvironment + trl_success (quickstart arithmetic)",
        "metric": f"held-out success ({len(heldout)} tasks x {quickstart.EVAL_SAMPLES} sampled)",
        "before": evals[0],
        "after": evals[-1],
        "tasks": len(heldout),
        "rl_steps": settings["rl_steps"],
        "seconds": round(time.perf_counter() - started, 1),
        "demonstrator_success": sum(t.outcome_reward for t in demos) / len(demos),
        "trl_reward_calls": tally["rollouts"],
        "run": measured,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.quick), indent=2))
