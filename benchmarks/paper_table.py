"""The Agent-R1 paper's table, here: the warm start with no RL against GRPO, PPO, REINFORCE++ and RLOO.

The paper (arXiv 2511.14460; the Agent-R1 repository's docs/experiments.md) trains Qwen3-4B on four
kinds of agent task with one framework and compares a training-free ReAct agent with four RL
methods. This script repeats the design on the tasks this machine can run offline, with the tiny
model (a ~1M-parameter Qwen2 with a byte tokenizer, ``agent_r1.models.tiny``) on 2 CPU cores:

- ``arithmetic``: the quickstart's task (``x*y+z`` with a one-operation calculator, two calls
  needed), standing in for GSM8K-with-a-tool;
- ``household``: the ALFWorld-like household (``agent_r1/tasks/household.py``), held out on seen
  and unseen layouts as ALFWorld's valid_seen / valid_unseen;
- ``multihop_world``: the fictional multi-hop encyclopedia behind a BM25 search tool
  (``agent_r1/tasks/multihop_world.py``), standing in for HotpotQA (EM and F1, searches per question);
- ``shop``: the WebShop-like shop (``agent_r1/tasks/shop.py``): search, click a product, choose its
  options, buy; scored as WebShop is, by the purchase's reward (attributes, options and price
  matched: partial credit) averaged x100, with success (reward 1) beside it.

Rows (everything equal between them but the advantage estimator, and PPO's critic):

- ``no RL``: the supervised warm start on the task's imperfect demonstrator, measured as every other
  row is (the paper's ReAct row is a prompted model; ours has to be taught the tool format first);
- ``GRPO`` (``grpo``), ``PPO`` (``gae_token``: token-level GAE with a critic, a value head on a copy of
  the warm start), ``REINFORCE++`` (``reinforce_pp``: returns whitened over the batch, as
  verl's ``reinforce_plus_plus`` that the Agent-R1 repository's scripts run), ``RLOO`` (``rloo``).

Every RL row: the same warm start, the same training tasks in the same order, the same number of
sampled trajectories (steps x tasks per step x group size), PPO-clip, the sampler's log-probs as the
old ones, no KL, no dynamic filter (a filter would drop groups that ``reinforce_pp`` learns from).
Held-out success is sampled at temperature 1 (``eval_n`` episodes per task) with the same sampling
seeds for every row, so the rows differ only by the weights.

``--context`` repeats the paper's context-management comparison on the arithmetic task instead:
GRPO with the env's context policy ``append`` (the whole history) against ``sliding_window`` (the
task and the last turn only), each arm warm-started on demonstrations rendered through its own
policy. (``token_budget`` adds nothing here: an episode is a few short responses, the head and the
newest turn are always kept, so a budget that drops anything drops what the window drops.)

Prints the machine, one table in the paper's layout (mean and min-max over seeds, the paper's
figure beside), whether every RL row beat the no-RL row in every seed, and the ranking. Writes
``OUT/results.json``.

    python benchmarks/paper_table.py                                  # every task, 3 seeds
    python benchmarks/paper_table.py --tasks arithmetic --seeds 0 1 2
    python benchmarks/paper_table.py --context                        # context policies, arithmetic
    python benchmarks/paper_table.py --quick                          # minutes: a smoke run
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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from multiturn import own_step_loop

from agent_r1.models.loading import save_model
from agent_r1.models.precision import cpu_model
from agent_r1.models.tiny import build_tiny
from agent_r1.tasks.prepare import build, task_env
from agent_r1.train.config import config_from_dict
from agent_r1.train.process import set_torch_threads
from agent_r1.train.sft import SFTConfig, replay_demonstrations, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer

METHODS = {"GRPO": "grpo", "PPO": "gae_token", "REINFORCE++": "reinforce_pp", "RLOO": "rloo"}
NO_RL = "no RL"

# The paper's figures (Qwen3-4B; docs/experiments.md of the Agent-R1 repository): its ReAct row and
# the four methods, on the column each of our tasks stands in for.
PAPER = {
    "GSM8K acc": {NO_RL: 53.1, "GRPO": 83.3, "PPO": 78.1, "REINFORCE++": 78.9, "RLOO": 81.6},
    "HotpotQA acc": {NO_RL: 25.8, "GRPO": 59.4, "PPO": 56.7, "REINFORCE++": 52.8, "RLOO": 55.2},
    "ALFWorld seen": {NO_RL: 7.14, "GRPO": 81.29, "PPO": 76.42, "REINFORCE++": 73.84, "RLOO": 79.08},
    "ALFWorld unseen": {NO_RL: 2.98, "GRPO": 74.58, "PPO": 72.38, "REINFORCE++": 69.57, "RLOO": 73.46},
    "WebShop score": {NO_RL: 51.58, "GRPO": 65.83, "PPO": 70.18, "REINFORCE++": 63.41, "RLOO": 68.02},
    "WebShop SR": {NO_RL: 23.8, "GRPO": 44.2, "PPO": 46.0, "REINFORCE++": 41.8, "RLOO": 45.1},
}


@dataclass(frozen=True)
class TableTask:
    """One task of the table: what it is, how the warm start and RL are sized, what it is scored by."""

    task: str  # the registered task (agent_r1.tasks.TASKS)
    task_kwargs: dict[str, Any] = field(default_factory=dict)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=lambda: {"test": ""})  # held-out split -> paper column
    sft_demos: int = 800
    sft_epochs: int = 3
    steps: int = 12
    tasks_per_step: int = 16
    group_size: int = 8
    lr: float = 2e-4
    max_tokens: int = 96
    eval_tasks: int = 100
    eval_n: int = 4
    qa: bool = False  # score EM and F1 and count searches
    metric: str = "success"  # the table's figure: "success" (reward >= 1) or "score" (mean reward)
    success_column: str | None = None  # with metric "score": the paper's column for success beside it

    def spec(self):
        return build(self.task, self.task_kwargs)

    def env_factory(self, tokenizer, **context):
        return functools.partial(
            task_env, tokenizer, self.task, task_kwargs=self.task_kwargs, **{**self.env_kwargs, **context}
        )


TASKS = {
    # The quickstart's sizes (agent_r1/commands/quickstart.py).
    "arithmetic": TableTask("arithmetic", columns={"test": "GSM8K acc"}),
    "household": TableTask(
        "household",
        # Answered by the listed action's number, one token, rather than by copying ~25 characters
        # (the tiny model's warm start is 0.00 either way: agent_r1/tasks/household.py).
        task_kwargs={"numbered": True, "error_rate": 0.4},
        columns={"test": "ALFWorld seen", "unseen": "ALFWorld unseen"},
        sft_epochs=2,
        steps=8,
        tasks_per_step=8,
        max_tokens=8,
    ),
    "multihop_world": TableTask(
        "multihop_world",
        # Bridge and comparison questions (two searches), two passages a search: a whole episode fits
        # the tiny model's 2,048 positions.
        task_kwargs={"mix": {"bridge": 0.5, "comparison": 0.5}, "top_k": 2, "max_turns": 3},
        columns={"test": "HotpotQA acc"},
        max_tokens=96,
        qa=True,
    ),
    "shop": TableTask(
        "shop",
        # Products and buy answered by number (one token), options by their value (a word of the
        # instruction; its number is a look-up the tiny model does not make); the search names the
        # category alone (the tiny model garbles a query copied out of the instruction). WebShop's
        # score. docs/paper_table.md, "The shop".
        task_kwargs={"numbered": True, "error_rate": 0.5, "query": "category", "options_by_text": True},
        columns={"test": "WebShop score"},
        max_tokens=72,
        metric="score",
        success_column="WebShop SR",
    ),
}
QUICK = {"sft_demos": 200, "sft_epochs": 1, "steps": 2, "tasks_per_step": 4, "group_size": 4, "eval_tasks": 8}
CONTEXTS = {
    "append": {"context": "append"},
    "sliding_window": {"context": "sliding_window", "context_kwargs": {"k": 1}},
}


def warm_start(table_task: TableTask, seed: int, out: Path, **context) -> tuple[Any, Any, dict]:
    """The supervised warm start of one seed, saved to ``out`` (PPO's critic loads its body there):
    ``sft_demos`` demonstrations of the task's demonstrator replayed through the env (the RL tokens)."""
    spec = table_task.spec()
    model, tokenizer = build_tiny(seed=seed)
    rows = spec.make_dataset(table_task.sft_demos, split="train", seed=seed + 1)
    demos = replay_demonstrations(
        table_task.env_factory(tokenizer, **context), tokenizer, rows, spec.demonstrate, seed=seed
    )
    losses = train_sft(
        model,
        sft_sequences(demos),
        SFTConfig(epochs=table_task.sft_epochs, batch_size=16, micro_batch_size=16, seed=seed),
        pad_token_id=tokenizer.pad_token_id,
    )
    save_model(model, tokenizer, out)
    info = {
        "demonstrator_success": statistics.fmean(t.outcome_reward for t in demos),
        "sft_loss": [round(losses[0], 4), round(losses[-1], 4)],
    }
    return model, tokenizer, info


def config_for(table_task: TableTask, advantage: str, seed: int, run_dir: Path, model_path: str) -> dict:
    """One RL row's config; only ``algorithm.advantage`` differs between rows (and PPO builds a critic)."""
    rows = table_task.tasks_per_step * table_task.group_size
    return {
        "model": {"path": model_path},
        "rollout": {
            "n": table_task.group_size,
            "temperature": 1.0,
            "eval_temperature": 1.0,
            "eval_n": table_task.eval_n,
            "max_tokens": table_task.max_tokens,
            "max_steps": table_task.spec().max_turns,
            "max_batch_size": max(rows, min(table_task.eval_tasks * table_task.eval_n, 512)),
        },
        "algorithm": {
            "advantage": advantage,
            "policy_loss": "ppo_clip",
            "dynamic_filter": False,
            "old_logprobs": "sampler",  # the engine shares the learner's model: its log-probs are the learner's
        },
        "trainer": {
            "steps": table_task.steps,
            "tasks_per_step": table_task.tasks_per_step,
            "mini_batches": 2,
            "lr": table_task.lr,
            "critic_lr": table_task.lr,
            "micro_batch_tokens": 16384,
            "seed": seed,
            "run_dir": str(run_dir),
            "retain_freed_memory": True,
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False, "report": False},
    }


def heldout(trainer: Trainer, table_task: TableTask, tasks: list[dict], split: str, seed: int) -> dict:
    """Held-out metrics of the trainer's current weights on ``tasks``: success (the task's reward >= 1),
    and for QA exact match, F1 and searches per question; actions per episode. The sampling seeds
    depend on (seed, split) only, the same for every row."""
    trainer.schedule.newest_weights()
    base = f"paper-table:{seed}:{split}"
    groups = trainer.rollouts.collect(
        trainer.rollouts.submit(tasks, table_task.eval_n, base, evaluation=True)
    )
    by_id = {str(task["id"]): task for task in tasks}
    spec = table_task.spec()
    f1_reward = (
        build(table_task.task, {**table_task.task_kwargs, "reward": "f1"}).reward if table_task.qa else None
    )
    success, scores, f1s, calls, actions = [], [], [], [], []
    for group in groups:
        for trajectory in group.trajectories:
            success.append(float(trajectory.outcome_reward >= 1.0))
            scores.append(trajectory.outcome_reward)
            actions.append(len(trajectory.steps))
            if table_task.qa:
                calls.append(sum(s.info.get("tool_counts", {}).get("calls", 0) for s in trajectory.steps))
                text = trajectory.steps[-1].response_text if trajectory.steps else ""
                answer = spec.extract_answer(text)
                f1s.append(0.0 if answer is None else f1_reward(answer, by_id[group.task_id]))
    out = {
        "success": statistics.fmean(success),
        "score": statistics.fmean(scores),
        "actions": statistics.fmean(actions),
    }
    if table_task.qa:
        out |= {"em": out["success"], "f1": statistics.fmean(f1s), "searches": statistics.fmean(calls)}
    return out


def run_seed(
    table_task: TableTask, seed: int, methods: list[str], tmp: Path, *, context: dict | None = None
) -> dict:
    """The no-RL row and each of ``methods`` for one task and seed: the warm start, measured once on
    the first method's trainer before it trains, then each method from it."""
    started = time.perf_counter()
    context = context or {}
    warm_dir = tmp / f"{table_task.task}-{seed}-warm"
    warm, tokenizer, warm_info = warm_start(table_task, seed, warm_dir, **context)
    warm_seconds = time.perf_counter() - started
    spec = table_task.spec()
    train_tasks = spec.make_dataset(table_task.steps * table_task.tasks_per_step, split="train", seed=seed)
    heldout_tasks = {
        split: spec.make_dataset(table_task.eval_tasks, split=split, seed=seed)
        for split in table_task.columns
    }
    results: dict[str, Any] = {"warm_start": {**warm_info, "seconds": round(warm_seconds, 1)}}
    for method in methods:
        run_dir = tmp / f"{table_task.task}-{seed}-{method}"
        config = config_from_dict(config_for(table_task, METHODS[method], seed, run_dir, str(warm_dir)))
        trainer = Trainer(
            config,
            tokenizer=tokenizer,
            model=copy.deepcopy(warm),
            env_factory=table_task.env_factory(tokenizer, **context),
            train_tasks=train_tasks,
            val_tasks=next(iter(heldout_tasks.values())),
        )
        own_step_loop(trainer, run_dir)
        try:
            if NO_RL not in results:
                results[NO_RL] = {
                    split: heldout(trainer, table_task, tasks, split, seed)
                    for split, tasks in heldout_tasks.items()
                }
                print(
                    f"  {table_task.task} seed {seed} {NO_RL}: {_cell_line(results[NO_RL], table_task)}",
                    flush=True,
                )
            row_started = time.perf_counter()
            for step in range(1, table_task.steps + 1):
                trainer.step = step
                trainer.run_dir.log(step, trainer.train_step(step))
            train_seconds = time.perf_counter() - row_started
            results[method] = {
                split: heldout(trainer, table_task, tasks, split, seed)
                for split, tasks in heldout_tasks.items()
            }
            results[method]["train_seconds"] = round(train_seconds, 1)
            results[method]["trajectories"] = (
                table_task.steps * table_task.tasks_per_step * table_task.group_size
            )
        finally:
            trainer.run_dir.close()
            trainer.close()
        print(
            f"  {table_task.task} seed {seed} {method}: {_cell_line(results[method], table_task)}", flush=True
        )
    return results


def _cell_line(result: dict, table_task: TableTask) -> str:
    parts = []
    for split in table_task.columns:
        r = result[split]
        parts.append(
            f"{split} success {r['success']:.3f}"
            + (f" score {r['score']:.3f}" if table_task.metric == "score" else "")
            + (f" F1 {r['f1']:.3f} searches {r['searches']:.2f}" if table_task.qa else "")
        )
    if "train_seconds" in result:
        parts.append(f"{result['train_seconds']:.0f}s")
    return ", ".join(parts)


def summarise(runs: dict[int, dict], rows: list[str], table_task: TableTask) -> dict:
    """Per row and held-out split: the task's metric's mean and min-max over seeds (percent), and per
    RL row whether it beat the no-RL row in every seed."""
    out: dict[str, Any] = {}
    metric = table_task.metric
    for row in rows:
        out[row] = {}
        for split in table_task.columns:
            values = [100 * runs[s][row][split][metric] for s in runs]
            gains = [100 * (runs[s][row][split][metric] - runs[s][NO_RL][split][metric]) for s in runs]
            out[row][split] = {
                "mean": statistics.fmean(values),
                "min": min(values),
                "max": max(values),
                "above_no_rl_every_seed": all(g > 0 for g in gains) if row != NO_RL else None,
                "gain_per_seed": gains,
            }
            if metric != "success":
                out[row][split]["success"] = statistics.fmean(
                    100 * runs[s][row][split]["success"] for s in runs
                )
            if table_task.qa:
                out[row][split]["f1"] = statistics.fmean(100 * runs[s][row][split]["f1"] for s in runs)
                out[row][split]["searches"] = statistics.fmean(runs[s][row][split]["searches"] for s in runs)
        if row != NO_RL:
            out[row]["train_seconds"] = statistics.fmean(runs[s][row]["train_seconds"] for s in runs)
    return out


def print_table(summary: dict, tasks: list[str], rows: list[str]) -> None:
    columns = [(name, split, TASKS[name].columns[split]) for name in tasks for split in TASKS[name].columns]
    header = ["method"] + [f"{name}/{split} (paper: {paper})" for name, split, paper in columns]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        cells = [row]
        for name, split, paper in columns:
            s = summary[name][row][split]
            cell = f"{s['mean']:.1f} ({s['min']:.1f}-{s['max']:.1f})"
            cell += f" [{PAPER[paper][row]:.1f}]" if paper in PAPER and row in PAPER[paper] else ""
            if TASKS[name].qa:
                cell += f", F1 {s['f1']:.1f}, {s['searches']:.2f} searches"
            if "success" in s:
                cell += f", success {s['success']:.1f}"
                sr = PAPER.get(TASKS[name].success_column or "", {})
                cell += f" [{sr[row]:.1f}]" if row in sr else ""
            cells.append(cell)
        print("| " + " | ".join(cells) + " |")
    for name in tasks:
        rl = [row for row in rows if row != NO_RL]
        split = next(iter(TASKS[name].columns))
        means = {row: summary[name][row][split]["mean"] for row in rl}
        ranked = sorted(rl, key=lambda row: -means[row])
        ranking = " > ".join(ranked) if len(rl) == 1 or len(set(means.values())) > 1 else "all equal"
        every = all(
            summary[name][row][s]["above_no_rl_every_seed"] for row in rl for s in TASKS[name].columns
        )
        paper_column = TASKS[name].columns[split]
        paper_ranking = sorted(rl, key=lambda row: -PAPER[paper_column][row]) if paper_column in PAPER else []
        print(
            f"{name}: every RL row above no RL in every seed: {'yes' if every else 'NO'}; ranking on {split}: "
            + ranking
            + (f" (paper, {paper_column}: {' > '.join(paper_ranking)})" if paper_ranking else "")
            + "; seconds of RL per row: "
            + ", ".join(f"{row} {summary[name][row]['train_seconds']:.0f}" for row in rl)
            + f"; gain over no RL per seed, on {split}: "
            + ", ".join(
                f"{row} " + "/".join(f"{g:+.1f}" for g in summary[name][row][split]["gain_per_seed"])
                for row in rl
            )
        )


def machine_line() -> str:
    return (
        f"machine: {cpu_model()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; "
        f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument(
        "--context", action="store_true", help="the context-management comparison (arithmetic, GRPO)"
    )
    parser.add_argument(
        "--contexts",
        nargs="+",
        default=list(CONTEXTS),
        choices=list(CONTEXTS),
        help="with --context: the arms",
    )
    parser.add_argument(
        "--quick", action="store_true", help="a smoke run: small warm start, 2 RL steps, 1 seed"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--out", default=None, help="where results.json goes (default: a temp folder)")
    args = parser.parse_args(argv)
    if args.threads:
        set_torch_threads(args.threads)
    seeds = args.seeds[:1] if args.quick else args.seeds
    out = Path(args.out or tempfile.mkdtemp(prefix="paper_table_"))
    out.mkdir(parents=True, exist_ok=True)
    print(machine_line(), flush=True)
    results: dict[str, Any] = {"machine": machine_line(), "seeds": seeds, "quick": args.quick}
    with tempfile.TemporaryDirectory(prefix="paper_table_runs_") as tmp:
        if args.context:
            results["context"] = run_context(args, seeds, Path(tmp))
        else:
            rows = [NO_RL, *args.methods]
            results["runs"], results["summary"] = {}, {}
            for name in args.tasks:
                table_task = replace(TASKS[name], **QUICK) if args.quick else TASKS[name]
                runs = {seed: run_seed(table_task, seed, args.methods, Path(tmp)) for seed in seeds}
                results["runs"][name] = runs
                results["summary"][name] = summarise(runs, rows, table_task)
            print_table(results["summary"], args.tasks, rows)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"results: {out / 'results.json'}")
    return 0


def run_context(args, seeds: list[int], tmp: Path) -> dict:
    """GRPO on arithmetic under each context policy, each arm warm-started through its own policy."""
    table_task = replace(TASKS["arithmetic"], **QUICK) if args.quick else TASKS["arithmetic"]
    out: dict[str, Any] = {}
    for arm in args.contexts:
        context = CONTEXTS[arm]
        runs = {seed: run_seed(table_task, seed, ["GRPO"], tmp / arm, context=context) for seed in seeds}
        gains = [
            100 * (runs[s]["GRPO"]["test"]["success"] - runs[s][NO_RL]["test"]["success"]) for s in seeds
        ]
        out[arm] = {"runs": runs, "gain_points": gains}
        print(
            f"{arm}: no RL {statistics.fmean(100 * runs[s][NO_RL]['test']['success'] for s in seeds):.1f} -> "
            f"GRPO {statistics.fmean(100 * runs[s]['GRPO']['test']['success'] for s in seeds):.1f} "
            f"(gain per seed {', '.join(f'{g:+.1f}' for g in gains)})",
            flush=True,
        )
    return out


if __name__ == "__main__":
    sys.exit(main())
