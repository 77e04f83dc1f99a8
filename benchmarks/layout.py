"""Training layout benchmark: prefix-merged + packed sequences vs one row per step
(docs/training.md, "Step-level batching").

Identical synthetic 5-turn append-context trajectories (shaped like multi-hop QA: a prompt, then per
turn a response and a longer tool observation) are scored by the learner three ways, each timing the
log-prob forward + backward of every response token and counting the tokens the model processes:

  (a) agent-r1: consecutive steps merged into one sequence, sequences packed under a token budget;
  (b) one row per step, no padding (packed the same way, so only the merge differs);
  (c) one row per step padded to a fixed prompt + response length, as the reference Agent-R1
      implementation does (max_prompt_length + max_response_length).

Two more cases compare prefix sharing, each against one row per step, side by side in one run:

  rewritten context: GRPO groups whose steps see a sliding window of the last 2 of 6 turns after a
      head (a system prompt with tool schema shared by every group, then the group's task), so steps
      share the head but do not extend each other: (d) one row per step, (e) merged, nothing shared,
      (f) one-level prefix trees (the trunk is the common prefix of a run of sequences; the layout
      before prefix tries, rebuilt here as ``PrefixTree``s that share only that trunk), (g) prefix
      tries over the micro-batch (``share_prefixes``);
  GRPO groups: append-context samples of several tasks under one shared system prompt, the same
      four layouts (h)-(k);
  re-rendered context: 6-turn samples whose template drops each past response's reasoning (its
      first half), so every step starts a new sequence that shares all but the last turn with the
      previous one: a deep trie, layouts (l)-(o).

Prints machine info and one table per case, with ratios against its first row, all measured in this
run.

    python benchmarks/layout.py            # CPU-sized defaults
    python benchmarks/layout.py --quick    # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import statistics
import time

import torch

from agent_r1.models.tiny import build_tiny_model
from agent_r1.train.batch import batch_of
from agent_r1.train.batching import (
    PrefixTree,
    TrainSequence,
    attention_pair_cost,
    count_tokens,
    pack_trees,
)
from agent_r1.train.learner import micro_batch_logprobs
from agent_r1.types import Step, Trajectory


def synthetic_trajectories(
    num: int, turns: int, prompt_len: int, response_len: int, observation_len: int, vocab: int, seed: int
) -> list[Trajectory]:
    """Append-context trajectories: step t+1's prompt = step t's prompt + response + observation."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    trajectories = []
    for i in range(num):
        prompt = tokens(prompt_len)
        steps = []
        for _ in range(turns):
            # Lengths vary +-25% like real responses and tool outputs do.
            response = tokens(rng.randint(response_len * 3 // 4, response_len * 5 // 4))
            steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response)))
            prompt = (
                prompt + response + tokens(rng.randint(observation_len * 3 // 4, observation_len * 5 // 4))
            )
        trajectories.append(Trajectory(task_id=str(i), steps=tuple(steps)))
    return trajectories


def time_packed(model, trajectories, *, merge: bool, token_budget: int) -> tuple[float, int]:
    """Forward + backward over packed sequences; returns (seconds, tokens processed)."""
    batch = batch_of(trajectories, micro_batch_tokens=token_budget, merge=merge)
    start = time.perf_counter()
    for mb in batch.micro_batches[0]:
        logprobs_K, _ = micro_batch_logprobs(model, mb, temperature=1.0)
        (-logprobs_K.sum()).backward()
    return time.perf_counter() - start, count_tokens(batch.sequences)


def group_trajectories(
    groups: int,
    samples: int,
    turns: int,
    *,
    window: int | None,
    rerendered: bool = False,
    system_len: int,
    task_len: int,
    response_len: int,
    observation_len: int,
    vocab: int,
    seed: int,
) -> list[Trajectory]:
    """GRPO groups under one system prompt: each group's samples start from system + its task; step
    t's prompt is that head and the previous turns (response + observation), all of them, or with
    ``window`` only the last ``window`` (a sliding-window context). ``rerendered``: the history shows
    each response without its first half (a template that drops past reasoning when it re-renders
    the conversation), so a step's prompt extends the previous prompt but not prompt + response."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    def around(n: int) -> int:
        return rng.randint(n * 3 // 4, n * 5 // 4)

    system = tokens(system_len)
    trajectories = []
    for g in range(groups):
        head = system + tokens(task_len)
        for k in range(samples):
            history: list[list[int]] = []
            steps = []
            for _ in range(turns):
                kept = history[-window:] if window else history
                response = tokens(around(response_len))
                prompt = head + [t for turn in kept for t in turn]
                steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[0.0] * len(response)))
                shown = response[len(response) // 2 :] if rerendered else response
                history.append(shown + tokens(around(observation_len)))
            trajectories.append(Trajectory(task_id=f"{g}.{k}", steps=tuple(steps)))
    return trajectories


def one_level_trees(sequences: list[TrainSequence], pair_cost: float, max_width: int) -> list[PrefixTree]:
    """Prefix trees of one level, as ``share_prefixes`` built them before prefix tries: in token
    order, a sequence joins the current tree when the cost model says so, and the tree shares only
    the common prefix of all its members (its trunk), laid out once, each member's rest after it."""

    def cost(width: int) -> float:
        return width + pair_cost * width * width

    trees: list[tuple[list[TrainSequence], int]] = []  # (members, trunk)
    for sequence in sorted(sequences, key=lambda s: s.token_ids):
        if trees:
            members, trunk = trees[-1]
            shared = min(trunk, len(os.path.commonprefix([members[-1].token_ids, sequence.token_ids])))
            width = shared + sum(len(m) - shared for m in [*members, sequence])
            alone = trunk + sum(len(m) - trunk for m in members)
            if shared and width <= max_width and cost(width) < cost(alone) + cost(len(sequence)):
                trees[-1] = ([*members, sequence], shared)
                continue
        trees.append(([sequence], len(sequence)))
    return [PrefixTree(tuple(m), (0,) + (trunk,) * (len(m) - 1)) for m, trunk in trees]


def time_micro_batches(model, micro_batches) -> float:
    """Seconds of the log-prob forward + backward over ``micro_batches``."""
    start = time.perf_counter()
    for mb in micro_batches:
        logprobs_K, _ = micro_batch_logprobs(model, mb, temperature=1.0)
        (-logprobs_K.sum()).backward()
    return time.perf_counter() - start


def sharing_layouts(model, trajectories, token_budget: int, labels: tuple[str, str, str, str]) -> dict:
    """The four layouts of a prefix-sharing case: name -> (micro-batches, tokens processed)."""
    pair_cost = attention_pair_cost(model.config)
    per_step = batch_of(trajectories, micro_batch_tokens=token_budget, merge=False)
    merged = batch_of(trajectories, micro_batch_tokens=token_budget)
    tries = batch_of(trajectories, micro_batch_tokens=token_budget, pair_cost=pair_cost)
    trees = one_level_trees(list(merged.sequences), pair_cost, token_budget)
    return {
        labels[0]: (per_step.micro_batches[0], per_step.train_tokens),
        labels[1]: (merged.micro_batches[0], merged.train_tokens),
        labels[2]: (pack_trees(trees, merged.rows, token_budget), count_tokens(trees)),
        labels[3]: (tries.micro_batches[0], tries.train_tokens),
    }


def time_padded(model, trajectories, *, token_budget: int) -> tuple[float, int]:
    """Forward + backward with one row per step, every row padded to max prompt + max response."""
    steps = [s for t in trajectories for s in t.steps]
    max_prompt = max(len(s.prompt_ids) for s in steps)
    max_response = max(len(s.response_ids) for s in steps)
    width = max_prompt + max_response
    rows_per_batch = max(1, token_budget // width)
    start = time.perf_counter()
    for i in range(0, len(steps), rows_per_batch):
        chunk = steps[i : i + rows_per_batch]
        input_ids = torch.zeros(len(chunk), width, dtype=torch.long)
        attention = torch.zeros(len(chunk), width, dtype=torch.long)
        target_mask = torch.zeros(len(chunk), width, dtype=torch.bool)
        for r, s in enumerate(chunk):
            # Left-pad the prompt to max_prompt, right-pad the response (the reference layout).
            p0 = max_prompt - len(s.prompt_ids)
            input_ids[r, p0:max_prompt] = torch.tensor(s.prompt_ids)
            input_ids[r, max_prompt : max_prompt + len(s.response_ids)] = torch.tensor(s.response_ids)
            attention[r, p0 : max_prompt + len(s.response_ids)] = 1
            target_mask[r, max_prompt : max_prompt + len(s.response_ids)] = True
        position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=input_ids, attention_mask=attention, position_ids=position_ids).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        targets = input_ids[:, 1:]
        token_logprobs = logprobs.gather(-1, targets[..., None])[..., 0]
        (-(token_logprobs * target_mask[:, 1:]).sum()).backward()
    return time.perf_counter() - start, len(steps) * width


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trajectories", type=int, default=16)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=48)
    parser.add_argument("--observation-len", type=int, default=96)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--token-budget", type=int, default=4096)
    parser.add_argument("--system-len", type=int, default=256, help="system prompt + tool schema")
    parser.add_argument("--task-len", type=int, default=32)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--window-samples", type=int, default=4, help="samples per group, window case")
    parser.add_argument("--window", type=int, default=2, help="turns a sliding window keeps")
    parser.add_argument("--window-turns", type=int, default=6)
    parser.add_argument("--group-samples", type=int, default=8, help="samples per group, GRPO case")
    parser.add_argument("--group-turns", type=int, default=2)
    parser.add_argument("--rerender-samples", type=int, default=2, help="samples per group, re-rendered")
    parser.add_argument("--group-response-len", type=int, default=32)
    parser.add_argument("--group-observation-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.prompt_len, args.response_len, args.observation_len = 4, 32, 12, 24
        args.hidden, args.layers, args.repeats, args.token_budget = 64, 2, 1, 1024
        args.system_len, args.task_len, args.groups, args.window_samples, args.group_samples = 48, 8, 2, 2, 3
        args.rerender_samples = 1
        args.group_response_len, args.group_observation_len = 8, 16

    torch.manual_seed(0)
    vocab = 263
    model = build_tiny_model(
        vocab, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden
    )
    model.train()
    trajectories = synthetic_trajectories(
        args.trajectories, args.turns, args.prompt_len, args.response_len, args.observation_len, vocab, seed=0
    )
    layouts = {
        "(a) agent-r1: merged + packed": lambda: time_packed(
            model, trajectories, merge=True, token_budget=args.token_budget
        ),
        "(b) one row per step, no padding": lambda: time_packed(
            model, trajectories, merge=False, token_budget=args.token_budget
        ),
        "(c) one row per step, padded": lambda: time_padded(
            model, trajectories, token_budget=args.token_budget
        ),
    }
    shape = dict(
        system_len=args.system_len,
        task_len=args.task_len,
        vocab=vocab,
        seed=1,
        response_len=args.group_response_len,
        observation_len=args.group_observation_len,
    )
    window_case = group_trajectories(
        args.groups,
        args.window_samples,
        args.window_turns,
        window=args.window,
        **shape,
    )
    group_case = group_trajectories(
        args.groups,
        args.group_samples,
        args.group_turns,
        window=None,
        **shape,
    )
    rerender_case = group_trajectories(
        args.groups,
        args.rerender_samples,
        args.window_turns,
        window=None,
        rerendered=True,
        **shape,
    )
    sharing = {
        "window": sharing_layouts(
            model,
            window_case,
            args.token_budget,
            (
                "(d) one row per step",
                "(e) merged, nothing shared",
                "(f) one-level trees (before)",
                "(g) prefix tries (after)",
            ),
        ),
        "groups": sharing_layouts(
            model,
            group_case,
            args.token_budget,
            (
                "(h) one row per step",
                "(i) merged, nothing shared",
                "(j) one-level trees (before)",
                "(k) prefix tries (after)",
            ),
        ),
        "rerender": sharing_layouts(
            model,
            rerender_case,
            args.token_budget,
            (
                "(l) one row per step",
                "(m) merged, nothing shared",
                "(n) one-level trees (before)",
                "(o) prefix tries (after)",
            ),
        ),
    }
    for case in sharing.values():
        for name, (micro_batches, tokens) in case.items():
            layouts[name] = lambda mbs=micro_batches, n=tokens: (time_micro_batches(model, mbs), n)

    results: dict[str, tuple[float, int]] = {}
    for name, run in layouts.items():
        run()  # warm-up
        model.zero_grad(set_to_none=True)
        times, tokens = [], 0
        for _ in range(args.repeats):
            seconds, tokens = run()
            model.zero_grad(set_to_none=True)
            times.append(seconds)
        results[name] = (statistics.median(times), tokens)

    params = sum(p.numel() for p in model.parameters())
    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}"
    )
    print(
        f"model: Qwen2 {params / 1e6:.1f}M params (hidden {args.hidden}, {args.layers} layers); "
        f"{args.trajectories} trajectories x {args.turns} turns, prompt {args.prompt_len}, "
        f"response ~{args.response_len}, observation ~{args.observation_len} tokens; "
        f"median of {args.repeats}"
    )
    print_table(results, list(results)[:3], "(a) agent-r1: merged + packed")
    print(
        f"\nrewritten context: {args.groups} groups x {args.window_samples} samples, a sliding window of "
        f"{args.window} of {args.window_turns} turns after system {args.system_len} + task "
        f"{args.task_len} tokens; response ~{args.group_response_len}, observation "
        f"~{args.group_observation_len}; pair cost {attention_pair_cost(model.config):.2e}"
    )
    print_table(results, list(sharing["window"]), "(d) one row per step")
    print(
        f"\nGRPO groups: {args.groups} groups x {args.group_samples} samples x {args.group_turns} turns "
        f"(append context) under one system prompt of {args.system_len} tokens, task {args.task_len}"
    )
    print_table(results, list(sharing["groups"]), "(h) one row per step")
    print(
        f"\nre-rendered context: {args.groups} groups x {args.rerender_samples} samples x "
        f"{args.window_turns} turns, each past response shown without its first half"
    )
    print_table(results, list(sharing["rerender"]), "(l) one row per step")


def print_table(results: dict[str, tuple[float, int]], names: list[str], base: str) -> None:
    """A markdown table of ``names``' tokens and seconds with ratios against ``base``."""
    base_time, base_tokens = results[base]
    print(f"| {'layout':<34} | {'tokens':>8} | {'x tokens':>8} | {'seconds':>8} | {'x time':>7} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
    for name in names:
        seconds, tokens = results[name]
        print(
            f"| {name:<34} | {tokens:>8} | {tokens / base_tokens:>8.2f} | {seconds:>8.3f} | "
            f"{seconds / base_time:>7.2f} |"
        )


if __name__ == "__main__":
    main()
