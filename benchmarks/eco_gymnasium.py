"""Ecosystem arm: a real Gymnasium env trained through ``env.name: gymnasium``, held-out maps before
and after RL.

Env: ``FrozenLake-v1``, 4x4, not slippery, a random map per task (``generate_random_map(4, p=0.8,
seed)``, passed as the task's ``make_kwargs.desc``); the built-in text hook draws the map with the
player as ``P``, the model answers one move per turn (left, down, right, up), Gymnasium's reward (1 at
the goal) is the step reward, a hole ends the episode. Held-out maps are disjoint from training
maps: a map is held out when a hash of its layout says so, whatever the seed.

Warm start: the tiny Qwen2 + byte-level ChatML tokenizer (``agent_r1.models.tiny``), supervised on
a noisy shortest-path planner (breadth-first search around the holes; at each turn, with probability
``ERROR_RATE``, a uniformly random move instead, after which it plans again from where it landed),
each demonstration replayed through the same ``GymnasiumEnv`` the RL uses (``agent_r1.train.sft``).
The clone inherits the planner's slips, so RL has room.

RL: the quickstart's settings (``agent_r1.commands.quickstart.rl_settings``: GRPO, PPO-clip, dynamic
filter, the sampler's log-probs as the old ones), one-word responses. Held-out success: the trainer's
evaluation before the first step and after the last, ``quickstart.EVAL_SAMPLES`` episodes per held-out
map sampled at temperature 1.

    python benchmarks/eco_gymnasium.py           # full (about 10 min on 2 idle cores)
    python benchmarks/eco_gymnasium.py --quick   # a smoke run (under a minute)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import tempfile
import time
from collections import deque
from pathlib import Path

import torch
from run_digest import digest

from agent_r1.commands import quickstart
from agent_r1.envs.ecosystem.gymnasium import GymnasiumEnv
from agent_r1.models.tiny import build_tiny
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer

SIZE = 4
MAX_TURNS = 10  # the shortest path is 6 moves on a 4x4 map
ERROR_RATE = 0.15  # the planner's chance of a random move at each turn
HELDOUT_FRACTION = 0.2
SYSTEM_PROMPT = "P: you, G: goal, H: hole. Reply left, down, right or up."
ENV_KWARGS = {
    "id": "FrozenLake-v1",
    "make_kwargs": {"is_slippery": False},
    "max_turns": MAX_TURNS,
    "system_prompt": SYSTEM_PROMPT,
}
FULL = {
    "sft_demos": 800,
    "sft_epochs": 3,
    "rl_steps": 10,
    "eval_tasks": 50,
    "tasks_per_step": 16,
    "group_size": 8,
}
QUICK = {
    "sft_demos": 48,
    "sft_epochs": 1,
    "rl_steps": 2,
    "eval_tasks": 4,
    "tasks_per_step": 2,
    "group_size": 4,
}
MOVES = {"left": (0, -1), "down": (1, 0), "right": (0, 1), "up": (-1, 0)}


def is_heldout(desc: list[str]) -> bool:
    return hashlib.sha256("".join(desc).encode()).digest()[0] < 256 * HELDOUT_FRACTION


def make_tasks(n: int, *, split: str, seed: int) -> list[dict]:
    """``n`` tasks of distinct maps of ``split`` ("train" or "test")."""
    from gymnasium.envs.toy_text.frozen_lake import generate_random_map

    rng = random.Random(f"frozenlake-{split}-{seed}")
    tasks, seen = [], set()
    while len(tasks) < n:
        desc = generate_random_map(size=SIZE, p=0.8, seed=rng.randrange(2**31))
        if "".join(desc) in seen or is_heldout(desc) != (split == "test"):
            continue
        seen.add("".join(desc))
        tasks.append(
            {"id": f"{split}-{seed}-{len(tasks)}", "seed": len(tasks), "make_kwargs": {"desc": desc}}
        )
    return tasks


def step_on(desc: list[str], cell: tuple[int, int], move: str) -> tuple[int, int]:
    """FrozenLake's move: one cell, or none at the edge."""
    row, col = cell[0] + MOVES[move][0], cell[1] + MOVES[move][1]
    return (row, col) if 0 <= row < len(desc) and 0 <= col < len(desc[0]) else cell


def shortest_path(desc: list[str], start: tuple[int, int]) -> list[str]:
    """The moves of a shortest path from ``start`` to G around the holes (breadth-first)."""
    parents: dict[tuple[int, int], tuple[tuple[int, int], str] | None] = {start: None}
    queue = deque([start])
    while queue:
        cell = queue.popleft()
        if desc[cell[0]][cell[1]] == "G":
            path = []
            while parents[cell] is not None:
                cell, move = parents[cell]
                path.insert(0, move)
            return path
        for move in MOVES:
            nxt = step_on(desc, cell, move)
            if nxt not in parents and desc[nxt[0]][nxt[1]] != "H":
                parents[nxt] = (cell, move)
                queue.append(nxt)
    raise ValueError(f"no path to G on {desc}")


def demonstrate(task: dict, rng: random.Random, error_rate: float = ERROR_RATE) -> list[str]:
    """The noisy planner's replies for one episode, cut where the env ends it."""
    desc, cell, replies = task["make_kwargs"]["desc"], (0, 0), []
    while len(replies) < MAX_TURNS:
        move = rng.choice(list(MOVES)) if rng.random() < error_rate else shortest_path(desc, cell)[0]
        replies.append(move)
        cell = step_on(desc, cell, move)
        if desc[cell[0]][cell[1]] in "GH":
            break
    return replies


def eval_success(metrics_file: Path) -> list[float]:
    rows = [json.loads(line) for line in metrics_file.read_text().splitlines() if line.strip()]
    return [row["eval/success"] for row in rows if "eval/success" in row]


def run(seed: int = 0, quick: bool = False) -> dict:
    """Warm start, then RL on FrozenLake maps; held-out success before and after."""
    settings = QUICK if quick else FULL
    started = time.perf_counter()
    torch.manual_seed(seed)
    model, tokenizer = build_tiny(seed=seed)

    def make_env() -> GymnasiumEnv:
        return GymnasiumEnv(tokenizer, **ENV_KWARGS)

    demo_tasks = make_tasks(settings["sft_demos"], split="train", seed=seed + 1)
    demos = replay_demonstrations(make_env, tokenizer, demo_tasks, demonstrate, seed=seed)
    sft = SFTConfig(epochs=settings["sft_epochs"], batch_size=16, micro_batch_size=16, seed=seed)
    train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
    heldout = make_tasks(settings["eval_tasks"], split="test", seed=seed)
    rl_tasks = make_tasks(settings["rl_steps"] * settings["tasks_per_step"], split="train", seed=seed + 2)
    with tempfile.TemporaryDirectory(prefix="eco_gymnasium_") as tmp:
        rl = quickstart.rl_settings(
            steps=settings["rl_steps"],
            tasks_per_step=settings["tasks_per_step"],
            group_size=settings["group_size"],
            lr=2e-4,
            seed=seed,
            run_dir=tmp,
            threads=None,
        )
        rl["rollout"] = {**rl["rollout"], "max_tokens": 8, "max_steps": MAX_TURNS}
        config = config_from_dict(
            {
                **rl,
                "model": {"path": ""},
                "env": {"name": "gymnasium", "kwargs": ENV_KWARGS},
                "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
            }
        )
        trainer = Trainer(config, tokenizer=tokenizer, model=model, train_tasks=rl_tasks, val_tasks=heldout)
        try:
            trainer.fit()
        finally:
            trainer.close()
        evals = eval_success(Path(tmp) / "metrics.jsonl")
        measured = digest(tmp)
    return {
        "env": f"gymnasium FrozenLake-v1 {SIZE}x{SIZE} not slippery, random maps (built-in text hook)",
        "metric": f"held-out success ({len(heldout)} maps x {quickstart.EVAL_SAMPLES} sampled)",
        "before": evals[0],
        "after": evals[-1],
        "tasks": len(heldout),
        "rl_steps": settings["rl_steps"],
        "seconds": round(time.perf_counter() - started, 1),
        "demonstrator_success": sum(t.total_reward > 0 for t in demos) / len(demos),
        "run": measured,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke run)")
    args = parser.parse_args()
    print(json.dumps(run(args.seed, args.quick), indent=2))
