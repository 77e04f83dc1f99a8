"""agent-r1 vs TRL's GRPOTrainer with tool calling, on the quickstart's two-call calculator task.

Task: the quickstart's ``arithmetic`` (``agent_r1/tasks/arithmetic.py``): "Compute x*y+z for x=37,
y=84, z=-612" with a one-operation calculator that knows x, y, z and ``ans``; success needs two calls
(``x*y``, then ``ans+z``) and ``<answer>ans</answer>``; reward 1 for the right answer, else 0.
Shared setup: the tiny Qwen2 + byte-level ChatML-with-tools tokenizer, the quickstart's supervised
warm start (``multiturn.warm_starts``: the imperfect demonstrator replayed through the ``ToolEnv``),
copied once per framework. Both then train for ``--minutes`` of wall clock with the same group size,
tasks per iteration, lr, max turns (4 responses), and the equal GRPO settings of
``benchmarks/trl_race.py`` (one optimizer step per iteration, no dynamic filter). Each framework
trains in a fresh interpreter of its own that loads the warm start from a file (``train_isolated``):
neither inherits the heap the warm start, the evaluations or the other framework left, nor a
process-wide setting: agent-r1's trainer applies the quickstart's (``trainer.retain_freed_memory``),
TRL runs with the defaults a TRL user has. The host's speed drifts: TRL's iterations 2-6 took 1.20x
as long at 13:38 as at 12:58 UTC on 2026-12-03 (the same tokens, each run alone on an idle machine).
So a fixed workload is timed before each framework and after the last (``speed_probe``): a ratio is
only as good as those probes are equal.

TRL runs its own tool loop (``GRPOTrainer(environment_factory=...)``, as in trl 1.16): per rollout a
``CalculatorEnvironment`` whose ``calculator`` method is the tool, the same calculator memory as
agent-r1's env; TRL parses ``<tool_call>`` JSON with its Qwen response template, calls the tool,
appends the chat template's tool-result tokens to the sampled ids and generates again, up to
``max_tool_calling_iterations`` = max turns - 1 times; then it trains on one sequence per rollout,
tool-result tokens masked out. The script checks that both frameworks build identical token ids for
the prompt and for the prompt after one tool call (with TRL's own suffix function).

Differences that remain (each one TRL's design, kept as it is):

- TRL has one token budget for the whole rollout (``max_completion_length``, tool results included)
  and no per-turn limit; agent-r1 stops each response at ``rollout.max_tokens`` (96). TRL gets
  ``max turns x (96 + twice a tool result's tokens)``, so no rollout that agent-r1 allows is cut
  shorter; its clipped ratio is printed.
- A malformed call ends TRL's rollout: ``parse_response`` falls back to plain text (the byte-level
  tokenizer's ``<tool_call>`` tags are special tokens, so they are dropped), which has no tool call,
  so the loop stops and the text is scored as the final answer (reward 0). agent-r1's ``ToolEnv``
  answers it with an error message and the episode goes on (up to the max turns). Printed: TRL's
  share of rollouts that ended on a response that is neither a call nor an answer, agent-r1's
  parse errors per rollout. ``--variant env.kwargs.malformed_calls=answer`` adds an agent-r1 row
  under TRL's rule (``ToolEnv(malformed_calls="answer")``: such a response is the final answer);
  held-out success is measured with the default env for every model either way.
- A tool that raises: TRL sends ``str({'error': message})``, agent-r1 its error text.
- The tool's JSON schema: TRL always passes ``tools=`` to the chat template, which renders the
  schema block; the quickstart's env renders none (its system prompt describes the calculator,
  ``SystemPromptHermes``). TRL's tokenizer gets the same template with that block switched off, so
  both prompts are identical (checked).

Measured: seconds per iteration (median wall-clock gap between iteration starts, after ``--warmup``),
sampled tokens per second (tokens the model generated, tool results excluded, over the iterations'
wall clock), training success of the last ``--last`` iterations, and held-out success of the final
model with agent-r1's evaluation for all (the quickstart's measure: ``quickstart.EVAL_SAMPLES``
episodes per held-out task sampled at temperature 1, the same seeds for every model).

    python benchmarks/vs_trl_multiturn.py              # 3 minutes of RL per framework
    python benchmarks/vs_trl_multiturn.py --quick      # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch
from multiturn import add_quickstart_arguments, train_for, warm_starts
from trl_race import (
    EQUAL_ALGORITHM,
    TRL,
    add_race_arguments,
    clock_steps,
    machine_line,
    markdown_table,
    median_after,
    probe_line,
    progress_printer,
    race,
    require_trl,
    train_in_fresh_process,
    train_trl,
    trl_config,
)

from agent_r1.commands import quickstart
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.tasks import arithmetic, get_task
from agent_r1.train.config import apply_overrides, config_from_dict
from agent_r1.train.evaluation import evaluate
from agent_r1.train.sft import replay_demonstrations
from agent_r1.train.trainer import Trainer

progress = progress_printer("vs_trl_multiturn")
TOOLS_BLOCK = "{%- if tools %}"  # the chat template's branch that renders the tools' JSON schemas


# --- TRL's side of the task -----------------------------------------------------------------------


class CalculatorEnvironment:
    """TRL's ``environment_factory`` contract: ``reset(**row)`` before each rollout, public methods
    are the tools. The calculator memory is agent-r1's ``ArithmeticEnv``'s."""

    def __init__(self) -> None:
        self.memory = arithmetic.CalculatorMemory()

    def reset(self, **task) -> None:
        self.memory.reset(task)

    def calculator(self, expression: str) -> str:
        """Evaluate one operation (+, - or *) on integers or the names x, y, z and ans.

        Args:
            expression: e.g. x*y or ans+z
        """
        return self.memory.evaluate(expression)


def trl_success(tally: Counter):
    """TRL's reward function: ``ToolEnv``'s outcome rule on the rollout's last message (an assistant
    message without tool calls is the final answer; anything else scores 0). ``tally`` counts the
    rollouts and those that ended on a response that is neither a call nor an answer: TRL's parser
    falls back to plain text for a malformed call (its tags dropped as special tokens), which ends the
    tool loop, so each of these is a rollout that agent-r1's env would have answered with an error
    message and continued."""

    def success(prompts, completions, environments, answer, **_) -> list[float]:
        rewards = []
        for messages, environment, target in zip(completions, environments, answer, strict=True):
            last = messages[-1]
            final = last["role"] == "assistant" and not last.get("tool_calls")
            found = arithmetic.extract_answer(last["content"]) if final else None
            tally["rollouts"] += 1
            tally["ended_without_answer"] += int(final and found is None)
            rewards.append(arithmetic.score(environment.memory.resolve(found), {"answer": target}))
        return rewards

    return success


def trl_tokenizer():
    """The tiny tokenizer for TRL: its template without the tools block (see the module docstring)
    and TRL's response template for Hermes ``<tool_call>`` JSON (the Qwen2.5 / Qwen3 one: TRL
    recognises only the model families' own template files, not this byte-level copy)."""
    from trl.chat_template_utils import qwen3_template

    template = build_tiny_tokenizer().chat_template
    if template.count(TOOLS_BLOCK) != 1:
        sys.exit(f"vs_trl_multiturn: the tiny chat template no longer has one {TOOLS_BLOCK!r} branch")
    tokenizer = build_tiny_tokenizer(chat_template=template.replace(TOOLS_BLOCK, "{%- if false %}"))
    tokenizer.response_template = qwen3_template
    return tokenizer


def demonstration(tokenizer, task: dict):
    """agent-r1's two-call episode of ``task`` (the demonstrator without its habit), as Steps."""
    return replay_demonstrations(
        lambda: arithmetic.make_env(tokenizer),
        tokenizer,
        [task],
        lambda t, rng: arithmetic.demonstrate(t, rng, error_rate=0.0),
    )[0].steps


def observation_tokens(tokenizer, task: dict) -> int:
    """Tokens between the first response and the second prompt's end: one tool result's turn."""
    first, second = demonstration(tokenizer, task)[:2]
    return len(second.prompt_ids) - len(first.prompt_ids) - len(first.response_ids)


def check_same_tokens(trainer, trl_tok, tokenizer, task: dict) -> None:
    """TRL renders the prompt with ``apply_chat_template(tools=...)`` and, after a call, appends
    ``_get_tool_suffix_ids`` (TRL's own function, private: there is no public one) to the sampled
    ids; agent-r1's env builds both its own way. The race is fair only if the model sees the same
    tokens."""
    first, second = demonstration(tokenizer, task)[:2]
    environment = CalculatorEnvironment()
    environment.reset(**task)
    prompt = trl_tok.apply_chat_template(
        [task["prompt"]],
        tools=[environment.calculator],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
    )["input_ids"][0]
    result = environment.calculator("x*y")
    suffix = trainer._get_tool_suffix_ids([{"role": "tool", "name": arithmetic.TOOL_NAME, "content": result}])
    if list(prompt) != list(first.prompt_ids):
        sys.exit("vs_trl_multiturn: TRL and agent-r1 build different prompt token ids")
    if [*prompt, *first.response_ids, *suffix] != list(second.prompt_ids):
        sys.exit("vs_trl_multiturn: TRL and agent-r1 build different token ids after a tool call")


# --- the two trainers -----------------------------------------------------------------------------


def agent_r1_config(args, run_dir: Path, overrides: list[str]):
    """The quickstart's RL settings with the equal algorithm (one optimizer step, no dynamic filter)."""
    settings = quickstart.rl_settings(
        steps=args.max_iterations,
        tasks_per_step=args.tasks_per_step,
        group_size=args.group_size,
        lr=args.lr,
        seed=args.seed,
        run_dir=str(run_dir),
        threads=args.threads,
    )
    settings["algorithm"] = {**settings["algorithm"], **EQUAL_ALGORITHM, "dynamic_filter": False}
    settings["trainer"] = {**settings["trainer"], "mini_batches": 1, "lr_schedule": "constant"}
    settings["model"] = {"path": ""}
    settings["logging"] = {"progress": False, "tensorboard": False, "dump_trajectories": False}
    return config_from_dict(apply_overrides(settings, overrides))


def run_agent_r1(model, tokenizer, tasks: list[dict], args, run_dir: Path, overrides: list[str]) -> dict:
    config = agent_r1_config(args, run_dir, overrides)
    trainer = Trainer(
        config,
        tokenizer=tokenizer,
        model=model,
        env_factory=functools.partial(
            arithmetic.make_env, tokenizer, max_turns=config.rollout.max_steps, **config.env.kwargs
        ),
        train_tasks=tasks,
    )
    # The weights after every iteration (a ~1M-parameter model: cheap), so that held-out success can
    # also be measured after as many iterations as the other framework ran.
    snapshots = []
    try:
        clock = clock_steps(trainer)
        rows = train_for(
            trainer,
            args.minutes * 60,
            run_dir,
            lambda step: snapshots.append({k: v.clone() for k, v in trainer.model.state_dict().items()}),
        )
        clock.mark()
    finally:
        trainer.close()

    def mean(key: str) -> float:
        return statistics.mean(r.get(key, 0.0) for r in rows)

    turns = mean("steps_per_trajectory/mean")
    ends = config.env.kwargs.get("malformed_calls") == "answer"
    handled = "each ended its rollout, as in TRL" if ends else "each answered, episode goes on"
    phases = ", ".join(f"{p} {mean('time/' + p):.2f}s" for p in ("rollout", "reference", "update"))
    return {
        **clock.gaps(),
        "success": [r["success/mean"] for r in rows],
        "sampled": [r["throughput/tokens_per_s"] * r["time/step"] for r in rows],
        "model": trainer.model,
        "snapshots": snapshots,
        "loop": f"{turns:.2f} turns, {mean('tools/calls_per_step') * turns:.2f} calls and "
        f"{mean('tools/parse_errors_per_step') * turns:.3f} parse errors ({handled}) per rollout; "
        f"{mean('train/tokens'):.0f} trained tokens per iteration; phases per iteration: {phases}",
    }


def run_trl(model, tasks: list[dict], args, out_dir: Path, max_completion_length: int, tokenizer) -> dict:
    from datasets import Dataset
    from trl import GRPOTrainer

    trl_tok = trl_tokenizer()
    config = trl_config(
        out_dir,
        batch=args.group_size * args.tasks_per_step,
        group_size=args.group_size,
        max_completion_length=max_completion_length,
        args=args,
        max_steps=args.max_iterations,
        max_tool_calling_iterations=get_task("arithmetic").max_turns - 1,
    )
    tally: Counter = Counter()

    def make_trainer(callbacks):
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=[trl_success(tally)],
            args=config,
            train_dataset=Dataset.from_list(tasks),
            processing_class=trl_tok,
            environment_factory=CalculatorEnvironment,
            callbacks=callbacks,
        )
        check_same_tokens(trainer, trl_tok, tokenizer, tasks[0])
        return trainer

    trainer, clock = train_trl(make_trainer, budget_s=args.minutes * 60)
    rows = [row for row in trainer.state.log_history if "reward" in row]

    def mean(key: str) -> float:
        return statistics.mean(r[key] for r in rows)

    return {
        **clock.gaps(),
        "success": [r["reward"] for r in rows],
        "sampled": [r["completions/mean_length"] * config.per_device_train_batch_size for r in rows],
        "model": trainer.model,
        "loop": f"{mean('tools/call_frequency'):.2f} calls per rollout, "
        f"{mean('tools/failure_frequency'):.1%} of calls failed, "
        f"{tally['ended_without_answer'] / max(tally['rollouts'], 1):.1%} of rollouts ended on a response that "
        f"is neither a call nor an answer (a malformed call ends the loop), "
        f"{mean('completions/clipped_ratio'):.1%} clipped by "
        f"max_completion_length={max_completion_length}",
    }


# --- each framework in a fresh interpreter --------------------------------------------------------


def train_isolated(framework: str, warm_path: Path, tasks: list[dict], args, run_dir: Path, extra) -> dict:
    """Train ``framework`` in a spawned interpreter of its own; its result, with ``model`` (the
    final weights in a copy of the warm start) and ``snapshots`` loaded back.

    In one process the second framework would inherit what ran before it: the heap after the warm
    start's SFT and the evaluations, and the allocator setting agent-r1's trainer applies
    (process-wide). Here each side starts from the same state.
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    result = train_in_fresh_process(
        _train,
        framework,
        str(warm_path),
        tasks,
        args,
        str(run_dir),
        extra,
        threads=args.threads,
        seed=args.seed,
    )
    weights = torch.load(run_dir / "weights.pt", weights_only=True)
    model = torch.load(warm_path, weights_only=False)
    model.load_state_dict(weights["final"])
    return {**result, "model": model, "snapshots": weights["snapshots"]}


def _train(framework: str, warm_path: str, tasks: list[dict], args, run_dir: str, extra) -> dict:
    """The child's side of ``train_isolated``: ``extra`` is TRL's ``max_completion_length`` or
    agent-r1's overrides; the weights go to ``run_dir/weights.pt``, the rest is returned."""
    model = torch.load(warm_path, weights_only=False)
    tokenizer = build_tiny_tokenizer()
    if framework == TRL:
        result = run_trl(model, tasks, args, Path(run_dir), extra, tokenizer)
    else:
        result = run_agent_r1(model, tokenizer, tasks, args, Path(run_dir), extra)
    weights = {"final": result.pop("model").state_dict(), "snapshots": result.pop("snapshots", None)}
    torch.save(weights, Path(run_dir) / "weights.pt")
    return result


# --- main -----------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=3.0, help="wall-clock RL budget per framework")
    parser.add_argument("--max-iterations", type=int, default=10_000, help="stop earlier after this many")
    parser.add_argument("--warmup", type=int, default=1, help="iterations left out of the timing median")
    parser.add_argument("--last", type=int, default=3, help="train success = mean of the last k iterations")
    add_quickstart_arguments(parser)
    add_race_arguments(parser, "algorithm.dynamic_filter=true (the quickstart's own setting)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.minutes, args.max_iterations, args.warmup, args.last = 0.05, 2, 1, 1
        args.sft_demos, args.sft_epochs, args.eval_tasks, args.tasks_per_step, args.group_size = (
            32,
            1,
            4,
            2,
            2,
        )
    torch.set_num_threads(args.threads)
    require_trl(args, "vs_trl_multiturn")

    spec = get_task("arithmetic")
    tokenizer = build_tiny_tokenizer()
    rl_tasks = spec.make_dataset(4000, split="train", seed=args.seed)  # the budget never wraps around
    heldout = spec.make_dataset(args.eval_tasks, split="test", seed=args.seed)
    progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
    warm, how = warm_starts(tokenizer, args, ("append",))["append"]
    max_turns = spec.max_turns
    env_factory = functools.partial(arithmetic.make_env, tokenizer, max_turns=max_turns)
    with tempfile.TemporaryDirectory(prefix="vs_trl_multiturn_") as tmp:
        eval_config = agent_r1_config(args, Path(tmp) / "eval", [])
        per_turn = eval_config.rollout.max_tokens
        trl_budget = max_turns * per_turn + (max_turns - 1) * 2 * observation_tokens(tokenizer, rl_tasks[0])

        def heldout_success(model) -> float:
            metrics = evaluate(
                eval_config, tokenizer=tokenizer, model=model, env_factory=env_factory, val_tasks=heldout
            )
            return metrics["eval/success"]

        start_success = heldout_success(copy.deepcopy(warm))
        progress(f"warm start: {how}, held-out success {start_success:.3f}")
        warm_path = Path(tmp) / "warm.pt"
        torch.save(warm, warm_path)
        train = functools.partial(train_isolated, warm_path=warm_path, tasks=rl_tasks, args=args)
        runs = {"agent-r1": functools.partial(train, "agent-r1", run_dir=Path(tmp) / "ar1", extra=[])}
        for i, variant in enumerate(args.variant):
            runs[f"agent-r1 {variant}"] = functools.partial(
                train, "agent-r1", run_dir=Path(tmp) / f"ar1_{i}", extra=variant.split(",")
            )
        if not args.skip_trl:
            runs[TRL] = functools.partial(train, TRL, run_dir=Path(tmp) / "trl", extra=trl_budget)
        results = race(
            runs,
            lambda r: heldout_success(r.pop("model")),
            seed=args.seed,
            length=f"{args.minutes:g} min",
            progress=progress,
        )
        trl = results.get(TRL)
        for r in results.values():
            # At equal wall clock the faster framework also runs more iterations: held-out success
            # after TRL's number of iterations separates speed from what the extra ones did.
            snapshots = r.pop("snapshots", None)
            if trl and snapshots and len(snapshots) >= len(trl["gaps"]):
                model = copy.deepcopy(warm)
                model.load_state_dict(snapshots[len(trl["gaps"]) - 1])
                r["heldout_at_trl_iterations"] = heldout_success(model)

    print(machine_line(with_trl=not args.skip_trl))
    print(
        f"task: quickstart arithmetic (calculator tool, two calls, <= {max_turns} turns); warm start: SFT "
        f"{args.sft_demos} demos x {args.sft_epochs} epochs, held-out success {start_success:.3f}"
    )
    print(
        f"setup: {args.tasks_per_step} tasks x {args.group_size} samples per iteration, max {per_turn} tokens "
        f"per turn (TRL: {trl_budget} per rollout), lr {args.lr}, RL budget {args.minutes:g} min per framework, "
        f"timing = median gap after {args.warmup} warm-up iterations, train success = mean of the last "
        f"{args.last}; held-out success on {args.eval_tasks} tasks x {quickstart.EVAL_SAMPLES} sampled"
    )
    base = results.get(TRL)

    def figures(r: dict) -> dict[str, float]:
        timed = slice(args.warmup, None) if len(r["gaps"]) > args.warmup else slice(None)
        return {
            "wall": median_after(r["gaps"], args.warmup),
            "cpu": median_after(r["cpu_gaps"], args.warmup),
            "tokens_per_s": sum(r["sampled"][timed]) / sum(r["gaps"][timed]),
        }

    header = ["framework", "iterations", "s/iter", "x TRL", "CPU s/iter", "x TRL", "sampled tokens/iter"]
    header += ["sampled tokens/s", "x TRL", "train success", "held-out success"]
    rows = []
    for name, r in results.items():
        f = figures(r)
        ratio = {k: f"{f[k] / figures(base)[k]:.2f}" if base else "-" for k in f}
        rows.append(
            [name, str(len(r["gaps"])), f"{f['wall']:.2f}", ratio["wall"], f"{f['cpu']:.2f}", ratio["cpu"]]
            + [f"{statistics.mean(r['sampled']):.0f}", f"{f['tokens_per_s']:.0f}", ratio["tokens_per_s"]]
            + [f"{statistics.mean(r['success'][-args.last :]):.3f}", f"{r['heldout']:.3f}"]
        )
    print(markdown_table(header, rows))
    print(probe_line(results))
    for name, r in results.items():
        print(f"{name} tool loop: {r['loop']}; {r['total']:.0f} s in all")
        print(f"{name} train success per iteration: " + " ".join(f"{x:.3f}" for x in r["success"]))
        print(f"{name} seconds per iteration: " + " ".join(f"{x:.2f}" for x in r["gaps"]))
    for name, r in results.items():
        if "heldout_at_trl_iterations" in r:
            n = len(base["gaps"])
            print(
                f"{name} held-out success after {n} iterations (TRL's count): {r['heldout_at_trl_iterations']:.3f}"
            )


if __name__ == "__main__":
    main()
