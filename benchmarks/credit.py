"""Credit assignment on a long-horizon task: trajectory-level GRPO vs step-level estimators.

The task is ``gridwalk`` (``agent_r1/tasks/gridwalk.py``): 6-10 moves per episode, the only reward
at the end, and the same cells (the same prompt ids) visited by many samples of a group. One
supervised warm start on the task's imperfect demonstrator (it sidesteps when the goal is straight
ahead) serves every arm and every seed. Then, for each seed and each estimator, the real trainer
(``agent_r1.train.trainer.Trainer``: ``AgentEnvLoop`` rollouts, PPO-clip, one model shared by the HF
engine and the learner) trains until the same number of sampled response tokens is spent, and
held-out success is measured along the way at the same token marks.

Arms (the ``algorithm.advantage`` names; everything else equal: warm start, lr, group size, tasks
per step, token budget, gamma (``--gamma``, default 1) and lam = 1, PPO settings):

- ``grpo``: the trajectory's group-normalised outcome on every step (Shao et al. 2024);
- ``step_grpo``: GRPO's term plus the step's return normalised within its anchor state (GiGPO, Feng
  et al. 2025, arXiv 2505.10978), the anchor states being identical prompts within a group;
- ``gae_step``: step-level GAE with a step-level critic (Agent-R1, arXiv 2511.14460), the critic a
  value head on a copy of the warm start, trained at the policy's learning rate.

Where credit went: every trained step is labelled from the env's ``info`` (``state``, ``move``) as a
*sidestep* (a perpendicular move when the goal is straight ahead: the warm start's habit, always a
wasted pair of moves), a *move toward* the goal, or another wasted move; the trainer's dumped
per-step advantages then give, per arm, the mean advantage of each kind, the share of the negative
credit (the sum of -A over steps with A < 0) that lands on wasted moves, the share of nonzero
advantages with the right sign (negative for wasted moves, positive for moves toward the goal), and
the standard deviation of the advantages of moves toward the goal (every one of them is right, so
what spreads them is the estimator's noise, and its scale).

Writes ``OUT/results.json`` (every curve, diagnostic and setting) and ``OUT/credit.png`` (held-out
success against sampled tokens, mean and min-max over seeds), prints the machine and one table
with each arm's final success, its seed spread and the difference from ``grpo``.

    python benchmarks/credit.py              # 3 arms x 3 seeds, ~15 min on 2 idle cores
    python benchmarks/credit.py --quick      # a smoke run (the test suite's)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from multiturn import own_step_loop

from agent_r1.models.loading import save_model
from agent_r1.models.tiny import build_tiny
from agent_r1.tasks import gridwalk
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer
from agent_r1.types import read_jsonl

ARMS = ("grpo", "step_grpo", "gae_step")
KINDS = ("sidestep", "toward", "other_waste", "invalid")


def step_kind(state: str, move: str | None) -> str:
    """What a move did from ``state`` (``"+dx,+dy"``): ``toward`` the goal, a ``sidestep`` (the
    demonstrator's habit: perpendicular while the goal is straight ahead), ``other_waste``, or
    ``invalid`` (no move)."""
    if move is None:
        return "invalid"
    dx, dy = (int(v) for v in state.split(","))
    mx, my = gridwalk.MOVES[move]
    if mx * dx > 0 or my * dy > 0:
        return "toward"
    if (dx == 0 and mx != 0) or (dy == 0 and my != 0):
        return "sidestep"
    return "other_waste"


def config_for(arm: str, args, seed: int, run_dir: Path, model_path: str) -> dict:
    """The training config of one arm; only ``algorithm.advantage.name`` differs between arms."""
    return {
        "model": {"path": model_path},
        "rollout": {
            "n": args.group_size,
            "temperature": 1.0,
            "eval_temperature": 1.0,
            "eval_n": args.eval_n,
            "max_tokens": 4,  # a move and the end-of-turn token; longer answers are invalid anyway
            "max_steps": gridwalk.MAX_DISTANCE + gridwalk.DEFAULT_SLACK,
            "max_batch_size": args.tasks_per_step * args.group_size,
        },
        "algorithm": {
            "advantage": {"name": arm, "gamma": args.gamma},
            "policy_loss": "ppo_clip",
            # The engine and the learner share one model: the sampler's log-probs are the learner's.
            "old_logprobs": "sampler",
        },
        "trainer": {
            "steps": 10_000,  # the token budget ends the run
            "tasks_per_step": args.tasks_per_step,
            "mini_batches": 2,
            "lr": args.lr,
            "critic_lr": args.lr,
            "micro_batch_tokens": 16384,
            "seed": seed,
            "run_dir": str(run_dir),
            "torch_threads": args.threads,
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": True, "report": False},
    }


def sampled_tokens(metrics: dict) -> int:
    """The response tokens a step sampled (the trainer reports them as a rate over the step's time)."""
    return round(metrics["throughput/tokens_per_s"] * metrics["time/step"])


def credit_of(trajectories_file: Path) -> list[tuple[str, float, bool]]:
    """(kind, advantage, trajectory succeeded) of every trained step of one dumped training step."""
    rows = []
    for trajectory in read_jsonl(trajectories_file):
        for step in trajectory.steps:
            kind = step_kind(step.info["state"], step.info["move"])
            rows.append((kind, float(step.info["advantage"]), bool(trajectory.info["success"])))
    return rows


def summarise_credit(rows: list[tuple[str, float, bool]]) -> dict:
    """Mean advantage per kind of step, right-sign share, and the noise on moves toward the goal."""
    out: dict = {"steps": len(rows)}
    for kind in KINDS:
        values = [a for k, a, _ in rows if k == kind]
        out[f"{kind}/count"] = len(values)
        out[f"{kind}/mean_advantage"] = statistics.fmean(values) if values else None
    signed = [(k, a) for k, a, _ in rows if a != 0.0]
    right = [(k == "toward") == (a > 0) for k, a in signed]
    out["nonzero_share"] = len(signed) / max(len(rows), 1)
    out["right_sign_share"] = statistics.fmean(right) if right else None
    toward = [a for k, a, _ in rows if k == "toward"]
    out["toward/advantage_std"] = statistics.pstdev(toward) if len(toward) > 1 else None
    failed_toward = [a for k, a, ok in rows if k == "toward" and not ok]
    out["toward_in_failed/mean_advantage"] = statistics.fmean(failed_toward) if failed_toward else None
    blame = [(k, -a) for k, a, _ in rows if a < 0]
    total_blame = sum(b for _, b in blame)
    out["blame_on_waste"] = sum(b for k, b in blame if k != "toward") / total_blame if total_blame else None
    return out


def warm_start(
    args,
    out: Path,
    env_factory=gridwalk.GridWalkEnv,
    demonstrate=gridwalk.demonstrate,
    batch_size: int = 32,
    per_demonstration: bool = False,
):
    """The one SFT warm start every arm and seed starts from, saved to ``out`` (the critic loads its
    body from ``model.path``): ``args.sft_demos`` demonstrations of ``demonstrate``, replayed through
    ``env_factory()`` (``benchmarks/context.py`` passes its arm's env), ``args.sft_epochs`` epochs of
    ``batch_size`` training sequences per optimizer step. With ``per_demonstration``, ``batch_size``
    counts demonstrations instead: a step takes as many sequences as ``batch_size`` demonstrations
    make on average, so envs whose layouts cut a demonstration into more sequences (a sliding
    window, a summary) get the same number of optimizer steps."""
    model, tokenizer = build_tiny(seed=0)
    demos = replay_demonstrations(
        env_factory,
        tokenizer,
        gridwalk.make_dataset(args.sft_demos, split="train", seed=1),
        demonstrate,
        seed=0,
    )
    sequences = sft_sequences(demos)
    if per_demonstration:
        batch_size = max(1, round(batch_size * len(sequences) / len(demos)))
    losses = train_sft(
        model,
        sequences,
        SFTConfig(epochs=args.sft_epochs, batch_size=batch_size, micro_batch_size=batch_size, seed=0),
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, out)
    demo_success = statistics.fmean(t.outcome_reward for t in demos)
    summary = {
        "demonstrator_success": demo_success,
        "sft_loss": [losses[0], losses[-1]],
        "sft_steps": len(losses),
        "sft_batch_sequences": batch_size,
    }
    return model, tokenizer, summary


def run_arm(arm: str, seed: int, warm, tokenizer, model_path: str, args, tmp: Path) -> dict:
    """Held-out success at every ``--eval-every`` tokens until ``--token-budget`` tokens are sampled."""
    run_dir = tmp / f"{arm}-{seed}"
    config = config_from_dict(config_for(arm, args, seed, run_dir, model_path))
    trainer = Trainer(
        config,
        tokenizer=tokenizer,
        model=copy.deepcopy(warm),
        env_factory=gridwalk.GridWalkEnv,
        train_tasks=gridwalk.make_dataset(4000, split="train", seed=seed),
        val_tasks=gridwalk.make_dataset(split="test"),
    )
    # Trainer.fit runs a fixed number of steps; this is its loop with a token budget instead.
    own_step_loop(trainer, run_dir)  # the config's tasks_per_step and seed are the arm's
    curve = [(0, trainer.evaluate()["eval/success"])]
    tokens, step, credit, started = 0, 0, [], time.perf_counter()
    try:
        next_eval = args.eval_every
        while tokens < args.token_budget:
            step += 1
            trainer.step = step
            metrics = trainer.train_step(step)
            tokens += sampled_tokens(metrics)
            credit += credit_of(run_dir / "trajectories" / f"step_{step:06d}.jsonl")
            if tokens >= next_eval or tokens >= args.token_budget:
                curve.append((tokens, trainer.evaluate()["eval/success"]))
                next_eval = (tokens // args.eval_every + 1) * args.eval_every
    finally:
        trainer.run_dir.close()
        trainer.close()
    return {
        "curve": curve,
        "tokens": tokens,
        "steps": step,
        "seconds": time.perf_counter() - started,
        "credit": summarise_credit(credit),
    }


def eval_points(runs: list[dict]) -> list[tuple[float, list[float]]]:
    """The k-th evaluation of every run, k = 0, 1, ...: (mean sampled tokens, success of each run).
    Every run evaluates at the first step at or past the same token marks, so the k-th ones align."""
    count = min(len(r["curve"]) for r in runs)
    return [
        (statistics.fmean(r["curve"][k][0] for r in runs), [r["curve"][k][1] for r in runs])
        for k in range(count)
    ]


def plot(results: dict, args, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for arm in ARMS:
        runs = [results["runs"][arm][str(seed)] for seed in args.seeds]
        points = eval_points(runs)
        tokens = [t for t, _ in points]
        ax.plot(
            tokens, [statistics.fmean(v) for _, v in points], marker="o", label=f"{arm} ({len(runs)} seeds)"
        )
        ax.fill_between(tokens, [min(v) for _, v in points], [max(v) for _, v in points], alpha=0.2)
    ax.set_xlabel("sampled response tokens (training rollouts)")
    ax.set_ylabel("held-out success (sampled, T=1)")
    ax.set_title("gridwalk: mean and min-max over seeds")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def arm_row(runs: list[dict]) -> dict:
    """One arm's table row over its seeds: means, and min / max where the seed spread matters.
    ``final``: held-out success after the token budget; ``auc``: the mean over the evaluations after
    the warm start's (less noisy: more episodes)."""
    final = [r["curve"][-1][1] for r in runs]
    auc = [statistics.fmean(s for _, s in r["curve"][1:]) for r in runs]

    def mean_of(key: str) -> float | None:
        values = [r["credit"][key] for r in runs if r["credit"][key] is not None]
        return statistics.fmean(values) if values else None

    return {
        "tokens": statistics.fmean(r["tokens"] for r in runs),
        "steps": statistics.fmean(r["steps"] for r in runs),
        "seconds": statistics.fmean(r["seconds"] for r in runs),
        "final": statistics.fmean(final),
        "final_min": min(final),
        "final_max": max(final),
        "auc": statistics.fmean(auc),
        "auc_min": min(auc),
        "auc_max": max(auc),
        "sidestep_advantage": mean_of("sidestep/mean_advantage"),
        "blame_on_waste": mean_of("blame_on_waste"),
        "right_sign": mean_of("right_sign_share"),
        "toward_std": mean_of("toward/advantage_std"),
    }


def progress(message: str) -> None:
    print(f"[credit {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/credit", help="output folder (default: %(default)s)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="RL seeds")
    parser.add_argument("--token-budget", type=int, default=20_000, help="sampled tokens per run")
    parser.add_argument("--eval-every", type=int, default=5_000, help="sampled tokens between evaluations")
    parser.add_argument("--sft-demos", type=int, default=400, help="warm-start demonstrations")
    parser.add_argument("--sft-epochs", type=int, default=2)
    parser.add_argument("--eval-n", type=int, default=16, help="samples per held-out task (24 tasks)")
    parser.add_argument("--tasks-per-step", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=2e-4, help="policy and critic learning rate")
    parser.add_argument(
        "--gamma", type=float, default=1.0, help="discount over steps, for every arm (GiGPO uses 0.95)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (see benchmarks/README.md)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.token_budget, args.eval_every = [0], 600, 300
        args.sft_demos, args.sft_epochs, args.eval_n = 64, 1, 1
        args.tasks_per_step, args.group_size = 2, 4

    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    results: dict = {"settings": {k: v for k, v in vars(args).items()}, "runs": {arm: {} for arm in ARMS}}
    with tempfile.TemporaryDirectory(prefix="credit_") as tmp_name:
        tmp = Path(tmp_name)
        progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
        warm, tokenizer, results["warm_start"] = warm_start(args, tmp / "warm_start")
        for seed in args.seeds:
            for arm in ARMS:
                progress(f"seed {seed}: {arm} for {args.token_budget} sampled tokens")
                run = run_arm(arm, seed, warm, tokenizer, str(tmp / "warm_start"), args, tmp)
                results["runs"][arm][str(seed)] = run
    results["wall_seconds"] = time.perf_counter() - started

    start = [results["runs"][arm][str(s)]["curve"][0][1] for arm in ARMS for s in args.seeds]
    table = {arm: arm_row([results["runs"][arm][str(s)] for s in args.seeds]) for arm in ARMS}
    results["table"] = table
    (out / "results.json").write_text(json.dumps(results, indent=1))
    plot(results, args, out / "credit.png")

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}"
    )
    ws = results["warm_start"]
    print(
        f"task: gridwalk (6-8 cells, budget +{gridwalk.DEFAULT_SLACK}); warm start {args.sft_demos} demos x "
        f"{args.sft_epochs} epochs (demonstrator success {ws['demonstrator_success']:.3f}); held-out "
        f"{len(gridwalk.split_offsets('test'))} tasks x {args.eval_n} sampled; {args.tasks_per_step} tasks x "
        f"{args.group_size} samples per step, lr {args.lr:g}, gamma {args.gamma:g}; seeds {args.seeds}; warm start held-out "
        f"success {min(start):.3f}-{max(start):.3f}"
    )
    columns = [
        ("tokens sampled", lambda r: f"{r['tokens']:.0f}"),
        ("steps", lambda r: f"{r['steps']:.1f}"),
        ("final success", lambda r: f"{r['final']:.3f}"),
        ("final seed min-max", lambda r: f"{r['final_min']:.3f}-{r['final_max']:.3f}"),
        ("final - grpo", lambda r: f"{r['final'] - table['grpo']['final']:+.3f}"),
        ("mean success", lambda r: f"{r['auc']:.3f}"),
        ("mean seed min-max", lambda r: f"{r['auc_min']:.3f}-{r['auc_max']:.3f}"),
        ("mean - grpo", lambda r: f"{r['auc'] - table['grpo']['auc']:+.3f}"),
        ("sidestep adv.", lambda r: fmt(r["sidestep_advantage"], "+.3f")),
        ("blame on waste", lambda r: fmt(r["blame_on_waste"])),
        ("right sign", lambda r: fmt(r["right_sign"])),
        ("toward adv. std", lambda r: fmt(r["toward_std"])),
        ("s/run", lambda r: f"{r['seconds']:.0f}"),
    ]
    print("| arm | " + " | ".join(name for name, _ in columns) + " |")
    print("|---" * (len(columns) + 1) + "|")
    for arm in ARMS:
        print(f"| {arm} | " + " | ".join(show(table[arm]) for _, show in columns) + " |")
    print(f"wrote {out / 'results.json'} and {out / 'credit.png'}; {results['wall_seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
