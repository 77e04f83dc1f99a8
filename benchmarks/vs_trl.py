"""agent-r1 vs TRL's GRPOTrainer on one single-turn task, both on CPU, in the same run.

Task: "Last letter, twice: abcd" -> "dd" (words of 3-6 random lowercase letters). Reward: the
``difflib.SequenceMatcher`` ratio between the response (special tokens stripped, whitespace trimmed)
and the target, in [0, 1]; one plain Python function scores both frameworks.

Shared setup: the ~1M-param tiny Qwen2 + byte-level ChatML tokenizer, warm-started by a short SFT and
saved once; both trainers start from that folder, each in a fresh interpreter of its own
(``train_isolated``), with a speed probe timed before each. The demonstrations have one systematic error, so that
RL has something to fix within a CPU-sized run: on ``HABIT`` of them the demonstrator writes the letter
once ("d", reward 0.67). The model learns the task and the habit's marginal, so it answers once about
that often; under greedy decoding it always does (the task the tiny model cannot learn in minutes,
reversing the word, showed no learning in either framework). Identical GRPO settings: group size
(``rollout.n`` / ``num_generations``), prompts per iteration, max new tokens, lr (constant, AdamW betas
0.9/0.999, no weight decay), grad-norm clip 1.0, temperature 1.0 (no top-p / top-k), no KL
(``kl_coef`` / ``beta`` = 0), group-std advantages, PPO clip 0.2 / 0.28, token-mean loss (TRL
``loss_type="dapo"``), one optimizer step per iteration. The script checks that both frameworks build
identical prompt token ids.

Measured: seconds per iteration (median of the wall-clock gaps between consecutive iterations after
``--warmup`` of them, so logging and data loading count for both) and reward: the mean training
reward of the last ``--last`` iterations, and the held-out reward of the final model (the same
evaluation code for both, and for the warm start): greedy, and sampled at temperature 1 (the policy
as trained; ``--eval-samples`` per task). Prints machine info and one table with ratios
agent-r1 / TRL.

Ten iterations by default (30 before 2026-12-01): by 2026-12-01 the warm start scored higher
(held-out greedy 0.72 where it had scored 0.50) and after 30 iterations both frameworks reached
held-out greedy 1.000, so "equal reward" compared two ceilings. After 10, neither is there (sampled
held-out reward ~0.85 from the warm start's ~0.75), so a framework that learned less per iteration
would show. Greedy reward stays close to 1 (it jumps once a task's two-letter answer passes 0.5);
the sampled figure is the one that discriminates.

    python benchmarks/vs_trl.py            # CPU-sized defaults (a few minutes)
    python benchmarks/vs_trl.py --quick    # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import difflib
import functools
import json
import random
import statistics
import string
import sys
import tempfile
from pathlib import Path

import torch
from trl_race import (
    EQUAL_ALGORITHM,
    TRL,
    add_race_arguments,
    clock_steps,
    machine_line,
    markdown_table,
    probe_line,
    progress_printer,
    race,
    require_trl,
    train_in_fresh_process,
    train_trl,
    trl_config,
)

from agent_r1.envs.context import task_messages
from agent_r1.flows.base import SingleStepFlow
from agent_r1.models.loading import load_tokenizer
from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.models.tokens import observation_ids
from agent_r1.train.config import apply_overrides, config_from_dict
from agent_r1.train.sft import SFTConfig, sft_sequences, train_sft
from agent_r1.train.trainer import Trainer
from agent_r1.types import Observation, SamplingParams, Step, Trajectory

SPECIAL_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|im_start|>")


# --- the task, shared verbatim by both frameworks ------------------------------------------------


HABIT = 0.6
"""Fraction of demonstrations that write the letter once instead of twice (the error RL fixes)."""


def make_tasks(n: int, seed: int) -> list[dict]:
    """``n`` tasks: {"prompt": [user message], "target": the word's last letter twice}."""
    rng = random.Random(seed)
    tasks = []
    for _ in range(n):
        word = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(3, 6)))
        tasks.append(
            {"prompt": [{"role": "user", "content": f"Last letter, twice: {word}"}], "target": word[-1] * 2}
        )
    return tasks


def demonstration(task: dict, rng: random.Random) -> str:
    """The demonstrator's answer: right, except that on ``HABIT`` of the tasks it writes one letter."""
    return task["target"][:1] if rng.random() < HABIT else task["target"]


def reward(response: str, target: str) -> float:
    """SequenceMatcher ratio of the cleaned response and the target (1.0 = exact)."""
    for token in SPECIAL_TOKENS:
        response = response.replace(token, "")
    return difflib.SequenceMatcher(None, response.strip(), target).ratio()


def trl_reward(prompts, completions, target, **_) -> list[float]:
    """TRL's reward-function signature over the same ``reward``."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [reward(text, t) for text, t in zip(texts, target, strict=True)]


def agent_r1_reward(response: str, task: dict) -> float:
    """SingleStepFlow's reward-function signature over the same ``reward``."""
    return reward(response, task["target"])


# --- shared warm start and evaluation -------------------------------------------------------------


def prompt_ids(tokenizer, task: dict) -> list[int]:
    """agent-r1's prompt ids for a task (chat template with the generation prompt)."""
    return observation_ids(Observation(messages=task_messages(task)), tokenizer)


def warm_start(folder: Path, tasks: list[dict], epochs: int, seed: int) -> float:
    """Tiny model + SFT on correct reversals, saved to ``folder``; returns the final SFT loss."""
    save_tiny_checkpoint(folder, seed=seed)
    tokenizer = load_tokenizer(str(folder))
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    eos = tokenizer.eos_token_id
    demos = []
    rng = random.Random(seed)
    for i, task in enumerate(tasks):
        response = [*tokenizer.encode(demonstration(task, rng), add_special_tokens=False), eos]
        step = Step(prompt_ids(tokenizer, task), response, logprobs=[0.0] * len(response), terminated=True)
        demos.append(Trajectory(str(i), (step,)))
    losses = train_sft(
        model, sft_sequences(demos), SFTConfig(epochs=epochs, seed=seed), pad_token_id=tokenizer.pad_token_id
    )
    model.save_pretrained(folder)
    return losses[-1]


@torch.no_grad()
def heldout_reward(model, tokenizer, tasks: list[dict], args) -> tuple[float, float]:
    """Mean reward on the held-out tasks (one left-padded batch): greedy, and sampled at temperature 1
    with ``args.eval_samples`` samples per task (seeded by ``args.seed``)."""
    model.eval()
    prompts = [prompt_ids(tokenizer, t) for t in tasks]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id
    ids_BT = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask_BT = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])

    def mean_reward(samples: int, **decoding) -> float:
        out_BT = model.generate(
            input_ids=ids_BT,
            attention_mask=mask_BT,
            max_new_tokens=args.max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=pad,
            num_return_sequences=samples,
            **decoding,
        )
        texts = tokenizer.batch_decode(out_BT[:, width:], skip_special_tokens=True)
        targets = [t["target"] for t in tasks for _ in range(samples)]  # generate groups a task's samples
        return statistics.mean(reward(text, t) for text, t in zip(texts, targets, strict=True))

    greedy = mean_reward(1, do_sample=False)
    torch.manual_seed(args.seed)
    sampled = mean_reward(args.eval_samples, do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
    return greedy, sampled


def load_model(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder)


# --- the two trainers -----------------------------------------------------------------------------


def run_agent_r1(folder: Path, tasks: list[dict], args, run_dir: Path, overrides: list[str]) -> dict:
    tokenizer = load_tokenizer(str(folder))
    model = load_model(folder)
    settings = {
        "model": {"path": str(folder)},
        "rollout": {
            "n": args.group_size,
            "temperature": 1.0,
            "max_tokens": args.max_new_tokens,
            "max_batch_size": args.group_size * args.prompts,
        },
        "algorithm": EQUAL_ALGORITHM,
        "trainer": {
            "steps": args.iterations,
            "tasks_per_step": args.prompts,
            "lr": args.lr,
            "lr_schedule": "constant",
            "seed": args.seed,
            "run_dir": str(run_dir),
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
    }
    config = config_from_dict(apply_overrides(settings, overrides))
    sampling = SamplingParams(temperature=1.0, max_tokens=args.max_new_tokens)
    flow = SingleStepFlow(tokenizer, sampling, agent_r1_reward)
    trainer = Trainer(config, tokenizer=tokenizer, model=model, flow=flow, train_tasks=tasks)
    clock = clock_steps(trainer)
    trainer.fit()
    clock.mark()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    phases = {
        key: statistics.mean(r.get(key, 0.0) for r in rows[args.warmup :])
        for key in (
            "time/rollout",
            "time/score",
            "time/batch",
            "time/old_logprobs",
            "time/reference",
            "time/values",
            "time/advantage",
            "time/update",
            "time/sync",
        )
    }
    return {
        **clock.gaps(),
        "rewards": [r["reward/mean"] for r in rows],
        "model": trainer.model,
        "tokenizer": tokenizer,
        "phases": phases,
    }


def run_trl(folder: Path, tasks: list[dict], args, out_dir: Path) -> dict:
    from datasets import Dataset
    from trl import GRPOTrainer

    tokenizer = load_tokenizer(str(folder))
    batch = args.group_size * args.prompts
    config = trl_config(
        out_dir, batch=batch, group_size=args.group_size, max_completion_length=args.max_new_tokens, args=args
    )
    trainer, clock = train_trl(
        lambda callbacks: GRPOTrainer(
            model=load_model(folder),
            reward_funcs=[trl_reward],
            args=config,
            train_dataset=Dataset.from_list(tasks),
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    )
    rewards = [row["reward"] for row in trainer.state.log_history if "reward" in row]
    return {
        **clock.gaps(),
        "rewards": rewards,
        "model": trainer.model,
        "tokenizer": tokenizer,
    }


def train_isolated(framework: str, folder: Path, tasks: list[dict], args, run_dir: Path, overrides) -> dict:
    """Train ``framework`` in a spawned interpreter of its own (``trl_race.train_in_fresh_process``: no heap
    or process-wide setting carried over from the warm start, the evaluations or the other
    framework); its result with ``model`` (saved by the child, loaded back) and ``tokenizer``."""
    result = train_in_fresh_process(
        _train,
        framework,
        str(folder),
        tasks,
        args,
        str(run_dir),
        overrides,
        threads=args.threads,
        seed=args.seed,
    )
    return {**result, "model": load_model(run_dir / "final"), "tokenizer": load_tokenizer(str(folder))}


def _train(framework: str, folder: str, tasks: list[dict], args, run_dir: str, overrides) -> dict:
    if framework == TRL:
        run = run_trl(Path(folder), tasks, args, Path(run_dir))
    else:
        run = run_agent_r1(Path(folder), tasks, args, Path(run_dir), overrides)
    run.pop("tokenizer")
    run.pop("model").save_pretrained(Path(run_dir) / "final")
    return run


def check_same_prompts(folder: Path, task: dict) -> None:
    """TRL renders conversational prompts with ``apply_chat_template(tokenize=True)``; agent-r1 with
    its own renderer. The comparison is only fair if both give the model the same tokens."""
    tokenizer = load_tokenizer(str(folder))
    trl_ids = tokenizer.apply_chat_template(
        [task["prompt"]], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"][0]
    if list(trl_ids) != prompt_ids(tokenizer, task):
        sys.exit("vs_trl: TRL and agent-r1 build different prompt token ids; the comparison would be unfair")


progress = progress_printer("vs_trl")


# --- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--iterations",
        type=int,
        default=10,
        help="training iterations per framework (10: short of the ceiling, see the module docstring)",
    )
    parser.add_argument("--warmup", type=int, default=3, help="iterations left out of the timing median")
    parser.add_argument("--last", type=int, default=5, help="training reward = mean of the last k iterations")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt (num_generations)")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per iteration")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--sft-tasks", type=int, default=2000, help="warm-start demonstrations")
    parser.add_argument("--sft-epochs", type=int, default=5)
    parser.add_argument("--eval-tasks", type=int, default=128, help="held-out tasks")
    parser.add_argument("--eval-samples", type=int, default=4, help="sampled held-out answers per task")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (default 1: steadier than 2 on a shared 2-core machine, see benchmarks/README.md)",
    )
    add_race_arguments(parser, "algorithm.old_logprobs=sampler or trainer.micro_batch_tokens=1024")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.warmup, args.last, args.group_size, args.prompts = 3, 1, 2, 4, 2
        args.max_new_tokens, args.sft_tasks, args.sft_epochs, args.eval_tasks = 8, 64, 1, 16
        args.eval_samples = 2
    if args.warmup >= args.iterations:
        parser.error("--warmup must be smaller than --iterations")
    torch.set_num_threads(args.threads)
    require_trl(args, "vs_trl")

    train_tasks = make_tasks(args.iterations * args.prompts * 4, seed=args.seed + 1)
    heldout = make_tasks(args.eval_tasks, seed=args.seed + 2)
    with tempfile.TemporaryDirectory(prefix="vs_trl_") as tmp:
        folder = Path(tmp) / "warm_start"
        sft_loss = warm_start(
            folder, make_tasks(args.sft_tasks, seed=args.seed + 3), args.sft_epochs, args.seed
        )
        check_same_prompts(folder, train_tasks[0])
        tokenizer = load_tokenizer(str(folder))
        start_greedy, start_sampled = heldout_reward(load_model(folder), tokenizer, heldout, args)
        progress(
            f"warm start: SFT loss {sft_loss:.3f}, held-out reward greedy {start_greedy:.3f}, "
            f"sampled {start_sampled:.3f}"
        )

        train = functools.partial(train_isolated, folder=folder, tasks=train_tasks, args=args)
        runs = {"agent-r1": functools.partial(train, "agent-r1", run_dir=Path(tmp) / "ar1", overrides=[])}
        for i, variant in enumerate(args.variant):
            runs[f"agent-r1 {variant}"] = functools.partial(
                train, "agent-r1", run_dir=Path(tmp) / f"ar1_{i}", overrides=variant.split(",")
            )
        if not args.skip_trl:
            runs[TRL] = functools.partial(train, TRL, run_dir=Path(tmp) / "trl", overrides=[])
        results = race(
            runs,
            lambda r: heldout_reward(r.pop("model"), r.pop("tokenizer"), heldout, args),
            seed=args.seed,
            length=f"{args.iterations} iterations",
            progress=progress,
        )

    print(machine_line(with_trl=not args.skip_trl))
    print(
        f"task: last letter of 3-6 letters twice, SequenceMatcher reward; warm start: SFT {args.sft_tasks} "
        f"demos ({HABIT:.0%} with one letter) x {args.sft_epochs} epochs (final loss {sft_loss:.3f}), "
        f"held-out reward greedy {start_greedy:.3f}, sampled {start_sampled:.3f}"
    )
    print(
        f"setup: {args.prompts} prompts x {args.group_size} samples per iteration, max new tokens "
        f"{args.max_new_tokens}, lr {args.lr}, {args.iterations} iterations, timing = median gap after "
        f"{args.warmup} warm-up iterations, train reward = mean of the last {args.last}"
    )
    base = results.get(TRL)

    def per_iter(r: dict, key: str) -> float:
        return statistics.median(r[key][args.warmup :])

    header = ["framework", "s/iter", "x TRL", "CPU s/iter", "x TRL", "total s", "train reward"]
    header += ["held-out greedy", "held-out sampled"]
    rows = []
    for name, r in results.items():
        wall, cpu = per_iter(r, "gaps"), per_iter(r, "cpu_gaps")
        wall_ratio = f"{wall / per_iter(base, 'gaps'):.2f}" if base else "-"
        cpu_ratio = f"{cpu / per_iter(base, 'cpu_gaps'):.2f}" if base else "-"
        train_reward = statistics.mean(r["rewards"][-args.last :])
        rows.append(
            [
                name,
                f"{wall:.3f}",
                wall_ratio,
                f"{cpu:.3f}",
                cpu_ratio,
                f"{r['total']:.1f}",
                f"{train_reward:.3f}",
            ]
            + [f"{r['heldout'][0]:.3f}", f"{r['heldout'][1]:.3f}"]
        )
    print(markdown_table(header, rows))
    print(probe_line(results))
    for name, r in results.items():
        if "phases" in r:
            total = sum(r["phases"].values())
            shares = ", ".join(f"{k[5:]} {v:.3f}s ({v / total:.0%})" for k, v in r["phases"].items() if v > 0)
            print(f"{name} phases (mean per iteration): {shares}")


if __name__ == "__main__":
    main()
