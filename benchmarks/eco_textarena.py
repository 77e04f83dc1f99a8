"""TextArena arm: held-out results of a tiny model before and after RL on two real TextArena games.

- Two players: ``TicTacToe-v0`` against the ``random`` opponent (a random legal move), both seats;
  the metric is the win rate on held-out seeds (another stream of the opponent's moves), greedy.
- One player: ``GuessTheNumber-v0`` with 1..15 and 4 guesses (``max_turns: 3``; TextArena counts
  its limit from 0), where binary search always hits; the metric is held-out success (a hit).

The tiny byte-level model (``agent_r1.models.tiny``) cannot play from scratch (every sample of a
task would earn the same reward, so GRPO would have nothing to compare), so each arm warm-starts
it on demonstrations (``agent_r1.train.sft``) by a scripted decent player with noise
(``agent_r1.envs.ecosystem.textarena_players``: win / block / centre / corner for Tic Tac Toe,
binary search for the number; with probability ``NOISE`` a random move instead), each game
recorded with ``play_scripted`` and replayed through the env as RL will show it. Then RL: the real
``Trainer`` (``AgentEnvLoop`` rollouts, GRPO, PPO-clip), evaluated before the first and after the
last step.

    python benchmarks/eco_textarena.py            # full sizes: 23 + 17 min measured under load 10-20 (idle: not measured)
    python benchmarks/eco_textarena.py --quick    # a smoke run (< 1 min idle)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

from run_digest import digest  # noqa: E402

from agent_r1.envs.ecosystem import textarena_players as players  # noqa: E402
from agent_r1.envs.ecosystem.textarena import TextArenaEnv, make_tasks  # noqa: E402
from agent_r1.models.loading import save_model  # noqa: E402
from agent_r1.models.tiny import build_tiny  # noqa: E402
from agent_r1.train.config import config_from_dict  # noqa: E402
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft  # noqa: E402
from agent_r1.train.trainer import Trainer  # noqa: E402

NOISE = 0.3
ARMS = {
    "TicTacToe-v0": {
        # The game's turns pile up under the default append context: with the byte tokenizer a seat's
        # 5th prompt is ~2,180 tokens, past rollout.max_prompt_tokens (2,048), so 44% of the training
        # games ended TRUNCATED, neither won nor lost (benchmarks/HISTORY.md, issue 65). The board is
        # in every observation: the last two turns are all a move needs.
        "env_kwargs": {"context": "sliding_window", "context_kwargs": {"k": 2}},
        "seats": (0, 1),
        "player": players.TicTacToePlayer,
        "metric": "held-out win rate vs random (both seats, T=1, 4 samples per game)",
    },
    "GuessTheNumber-v0": {
        "env_kwargs": {"game_kwargs": {"max_number": 15, "max_turns": 3}},
        "seats": (0,),
        "player": players.GuessTheNumberPlayer,
        "metric": "held-out success (a hit within 4 guesses, T=1, 4 samples per seed)",
        "full": {"sft_epochs": 6, "rl_steps": 20, "tasks_per_step": 8},  # short games: more steps
    },
}
FULL = {"demo_seeds": 64, "sft_epochs": 4, "rl_steps": 10, "tasks_per_step": 4, "n": 4, "eval_seeds": 16}
QUICK = {"demo_seeds": 4, "sft_epochs": 1, "rl_steps": 1, "tasks_per_step": 2, "n": 2, "eval_seeds": 2}
TRAIN_SEEDS, DEMO_SEEDS, EVAL_SEEDS = 0, 100_000, 200_000  # disjoint seed ranges


def run_game(game: str, seed: int, sizes: dict, tmp: Path) -> dict:
    arm = ARMS[game]
    if sizes is FULL:
        sizes = {**FULL, **arm.get("full", {})}
    start = time.perf_counter()
    model, tokenizer = build_tiny(seed=seed)
    factory = functools.partial(TextArenaEnv, tokenizer, game=game, **arm["env_kwargs"])
    demo_tasks = make_tasks(game, range(DEMO_SEEDS, DEMO_SEEDS + sizes["demo_seeds"]), arm["seats"])
    moves = {
        t["id"]: players.play_scripted(
            factory, tokenizer, t, arm["player"](NOISE, seed=seed * 7919 + t["seed"])
        )[0]
        for t in demo_tasks
    }
    demos = replay_demonstrations(factory, tokenizer, demo_tasks, lambda t, rng: moves[t["id"]])
    sft = SFTConfig(epochs=sizes["sft_epochs"], batch_size=8, micro_batch_size=8, seed=seed)
    losses = train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
    model_path = tmp / f"{game}-sft"
    save_model(model, tokenizer, model_path)
    sft_s = time.perf_counter() - start

    train_tasks = make_tasks(game, range(TRAIN_SEEDS, TRAIN_SEEDS + 4096), arm["seats"])
    val_tasks = make_tasks(game, range(EVAL_SEEDS, EVAL_SEEDS + sizes["eval_seeds"]), arm["seats"])
    run_dir = tmp / f"{game}-rl"
    config = config_from_dict(
        {
            "model": {"path": str(model_path)},
            "env": {"name": "textarena", "kwargs": {"game": game, **arm["env_kwargs"]}},
            "rollout": {
                "n": sizes["n"],
                "max_tokens": 6,
                "max_steps": 8,
                "temperature": 1.0,
                "eval_temperature": 1.0,
                "eval_n": 4,
            },
            "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip"},
            "trainer": {
                "steps": sizes["rl_steps"],
                "tasks_per_step": sizes["tasks_per_step"],
                "lr": 3e-4,
                "eval_every": sizes["rl_steps"],
                "seed": seed,
                "run_dir": str(run_dir),
            },
            "logging": {"progress": False, "report": False},
        }
    )
    Trainer(config, tokenizer=tokenizer, train_tasks=train_tasks, val_tasks=val_tasks).fit()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(row["step"], row["eval/success"]) for row in rows if "eval/success" in row]
    trained = [row for row in rows if "env/win" in row]
    return {
        "env": f"textarena:{game}",
        "metric": arm["metric"],
        "before": evals[0][1],
        "after": evals[-1][1],
        "tasks": len(val_tasks) * 4,
        "rl_steps": sizes["rl_steps"],
        "seconds": round(time.perf_counter() - start, 1),
        "sft_seconds": round(sft_s, 1),
        "sft_loss": [round(losses[0], 3), round(losses[-1], 3)],
        "demonstrations": len(demos),
        "demonstrator_success": sum(d.info.get("success", False) for d in demos) / len(demos),
        "train_win_by_step": [round(row["env/win"], 3) for row in trained],
        "train_invalid_by_step": [round(row["env/invalid_actions"], 3) for row in trained],
        "run": digest(run_dir),
    }


def run(seed: int = 0, quick: bool = False) -> dict:
    """Both games; the two-player game's figures are the headline, the single-player's under ``arms``."""
    sizes = QUICK if quick else FULL
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="eco_textarena-") as tmp:
        arms = [run_game(game, seed, sizes, Path(tmp)) for game in ARMS]
    headline = arms[0]
    return {
        **{k: headline[k] for k in ("env", "metric", "before", "after", "tasks", "rl_steps", "run")},
        "seconds": round(time.perf_counter() - start, 1),
        "arms": arms,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--game", choices=sorted(ARMS), help="run this game's arm only")
    args = parser.parse_args()
    if args.game:
        with tempfile.TemporaryDirectory(prefix="eco_textarena-") as tmp:
            result = run_game(args.game, args.seed, QUICK if args.quick else FULL, Path(tmp))
    else:
        result = run(args.seed, args.quick)
    print(json.dumps(result, indent=2), file=sys.stdout)
