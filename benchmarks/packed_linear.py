"""The HF engine's linear kernel against ``F.linear``: oneDNN on weights packed once
(``agent_r1.rollout.packed_linear``) vs MKL, over a model's projection shapes at several row counts.

For each row count M, every layer's seven projections (q, k, v, o, gate, up, down of a Llama-style
model: SmolLM2-135M's shapes by default) are multiplied once, layer after layer, each layer with
weights of its own, so that every weight is read from memory as in a forward (one layer's weights
reused would sit in cache and flatter both kernels); weights under ``packed_linear.MIN_ELEMENTS`` run
``F.linear`` in both columns, as in the engine (SmolLM2's k and v). Prints the GFLOP/s of both kernels (median of
``--repeats``), their ratio, and the largest difference between their outputs.

    python benchmarks/packed_linear.py                 # SmolLM2's shapes, 30 layers
    python benchmarks/packed_linear.py --quick         # smoke-test size (tests/test_benchmarks.py)
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
import torch.nn.functional as F
from roofline import timed  # a sibling module (its folder is on sys.path)

from agent_r1.rollout import packed_linear


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--kv", type=int, default=192, help="KV heads x head dim")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--rows", default="1,8,32,64,128,400,4096")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="smoke-test size: 2 layers, rows 1,8")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.rows, args.repeats = 2, "1,8", 1
    if not packed_linear.available():
        raise SystemExit("this torch build has no oneDNN packed linear")
    h, i, kv = args.hidden, args.intermediate, args.kv
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)]  # (out, in)
    generator = torch.Generator().manual_seed(0)
    weights = [
        [torch.randn(shape, generator=generator) * 0.02 for shape in shapes] for _ in range(args.layers)
    ]
    linears = packed_linear.PackedLinears(None)
    print(
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), load average {os.getloadavg()[0]:.1f}; "
        f"{args.layers} layers of {shapes} (out, in), fp32"
    )
    print("| rows | F.linear GFLOP/s | packed GFLOP/s | packed / F.linear | max difference |")
    print("|---|---|---|---|---|")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            inputs = {n: torch.randn(rows, n, generator=generator) for n in (h, i)}
            flops = 2 * rows * sum(o * n for o, n in shapes) * args.layers

            def run(linear, inputs=inputs) -> None:
                for layer in weights:
                    for weight in layer:
                        linear(inputs[weight.shape[1]], weight)

            # (each median after one warm-up run, which also packs the weights)
            plain = timed(lambda: run(F.linear), args.repeats)
            packed = timed(lambda: run(linears.linear), args.repeats)
            difference = max(
                float((F.linear(inputs[w.shape[1]], w) - linears.linear(inputs[w.shape[1]], w)).abs().max())
                for w in weights[0]
            )
            print(
                f"| {rows} | {flops / plain / 1e9:.1f} | {flops / packed / 1e9:.1f} | {plain / packed:.2f} | "
                f"{difference:.1e} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
