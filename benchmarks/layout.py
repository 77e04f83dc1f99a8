"""Training layout benchmark: prefix-merged + packed sequences vs one row per step (DESIGN.md, 4).

Identical synthetic 5-turn append-context trajectories (shaped like multi-hop QA: a prompt, then per
turn a response and a longer tool observation) are scored by the learner three ways, each timing the
log-prob forward + backward of every response token and counting the tokens the model processes:

  (a) agent-r1: consecutive steps merged into one sequence, sequences packed under a token budget;
  (b) one row per step, no padding (packed the same way, so only the merge differs);
  (c) one row per step padded to a fixed prompt + response length, as the reference Agent-R1
      implementation does (max_prompt_length + max_response_length).

Prints machine info and one table with ratios against (a), all measured in this run.

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
from agent_r1.train.batching import build_sequences, count_tokens, make_micro_batches, step_rows
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
    sequences = build_sequences(trajectories, merge=merge)
    micro_batches = make_micro_batches(sequences, step_rows(trajectories), token_budget)
    start = time.perf_counter()
    for mb in micro_batches:
        logprobs_K, _ = micro_batch_logprobs(model, mb, temperature=1.0)
        (-logprobs_K.sum()).backward()
    return time.perf_counter() - start, count_tokens(sequences)


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
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.prompt_len, args.response_len, args.observation_len = 4, 32, 12, 24
        args.hidden, args.layers, args.repeats, args.token_budget = 64, 2, 1, 1024

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
    base_time, base_tokens = results["(a) agent-r1: merged + packed"]
    print(f"| {'layout':<34} | {'tokens':>8} | {'x tokens':>8} | {'seconds':>8} | {'x time':>7} |")
    print(f"|{'-' * 36}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 9}|")
    for name, (seconds, tokens) in results.items():
        print(
            f"| {name:<34} | {tokens:>8} | {tokens / base_tokens:>8.2f} | {seconds:>8.3f} | "
            f"{seconds / base_time:>7.2f} |"
        )


if __name__ == "__main__":
    main()
