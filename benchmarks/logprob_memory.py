"""Peak memory of the learner's log-prob forward + backward: full logits vs the chunked LM head.

A Qwen2-shaped model with a large vocabulary (Qwen2.5's 151,936 by default) and a small body scores one
packed micro-batch of multi-turn sequences (a fraction of the tokens are responses, i.e. scored):

  (a) full logits: ``logits`` for every position, gathered at the scored ones, log-softmax in fp32
      (the learner's path before ``agent_r1.train.lm_head``);
  (b) chunked head: hidden states gathered at the scored positions, the head applied in chunks, the
      backward recomputing each chunk.

Each variant runs in its own fresh process (peak RSS is per process and never goes down); the table
gives the peak resident memory above the loaded model, and the ratio against (a), measured in this run.

    python benchmarks/logprob_memory.py            # ~5k tokens, vocab 151,936
    python benchmarks/logprob_memory.py --quick    # a smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys

import torch

VARIANTS = {"full": "(a) full logits", "chunked": "(b) chunked head"}


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def measure(variant: str, args: argparse.Namespace) -> dict:
    """In this process: build the model and micro-batch, run one forward + backward, report peaks."""
    from agent_r1.models.tiny import build_tiny_model
    from agent_r1.train.batch import batch_of
    from agent_r1.train.learner import full_logits_logprobs, micro_batch_logprobs, model_inputs

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from layout import synthetic_trajectories

    torch.manual_seed(0)
    model = build_tiny_model(
        args.vocab, hidden_size=args.hidden, num_layers=args.layers, intermediate_size=3 * args.hidden
    )
    trajectories = synthetic_trajectories(
        args.trajectories, args.turns, args.prompt_len, args.response_len, args.observation_len, args.vocab, 0
    )
    (mb,) = batch_of(trajectories, micro_batch_tokens=10**9).all_micro_batches
    base = _rss_mib()
    if variant == "full":
        inputs = model_inputs(model, mb)
        logprobs_K, entropy_K = full_logits_logprobs(
            model, inputs, mb.logit_index_K, mb.target_ids_K, 1.0, with_entropy=True
        )
    else:
        logprobs_K, entropy_K = micro_batch_logprobs(model, mb, 1.0, with_entropy=True)
    (-(logprobs_K.sum()) - 0.01 * entropy_K.sum()).backward()
    return {
        "variant": variant,
        "tokens": mb.num_tokens,
        "scored": int(mb.target_ids_K.numel()),
        "vocab": args.vocab,
        "peak_mib_above_model": round(_rss_mib() - base, 1),
        "logprob_sum": float(logprobs_K.sum()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=96)
    parser.add_argument("--observation-len", type=int, default=160)
    parser.add_argument("--quick", action="store_true", help="small sizes (smoke test)")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args()
    if args.quick:
        args.vocab, args.trajectories, args.turns = 20_000, 2, 2
        args.prompt_len, args.response_len, args.observation_len = 64, 32, 32
    if args.variant:
        print(json.dumps(measure(args.variant, args)))
        return
    results = {}
    for variant in VARIANTS:
        child = [a for a in sys.argv[1:]] + ["--variant", variant]
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), *child], capture_output=True, text=True, check=True
        )
        results[variant] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, chunked = results["full"], results["chunked"]
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}; "
        f"peak RSS of a fresh process per variant"
    )
    print(
        f"model: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; one micro-batch of "
        f"{full['tokens']} tokens, {full['scored']} scored; fp32, forward + backward with entropy"
    )
    print(f"| {'path':<20} | {'peak MiB above model':>20} | {'x memory':>8} | {'sum of log-probs':>16} |")
    print(f"|{'-' * 22}|{'-' * 22}|{'-' * 10}|{'-' * 18}|")
    for variant, label in VARIANTS.items():
        r = results[variant]
        ratio = r["peak_mib_above_model"] / max(full["peak_mib_above_model"], 1e-9)
        print(
            f"| {label:<20} | {r['peak_mib_above_model']:>20.1f} | {ratio:>8.2f} | {r['logprob_sum']:>16.3f} |"
        )
    # the two paths compute the same numbers (the test suite checks this closely; here a sanity bound)
    assert abs(full["logprob_sum"] - chunked["logprob_sum"]) <= 1e-4 * abs(full["logprob_sum"]) + 1e-3


if __name__ == "__main__":
    main()
