"""On-policy distillation vs RL on the quickstart task: steps to 90% of an RL-trained teacher.

The ``agent-r1 quickstart`` pipeline (``agent_r1/commands/quickstart.py``), in this process:

1. the tiny Qwen2 + byte-level ChatML tokenizer, supervised warm start on the imperfect demonstrator
   (the student);
2. the teacher: the warm start after ``--teacher-steps`` RL steps with the quickstart's settings
   (GRPO, PPO-clip, dynamic filtering), saved as a model folder; its held-out success T;
3. three arms from the same warm start, each for at most ``--max-steps`` steps, evaluated on the
   held-out tasks after every step, stopping at 0.9 T:
   - ``rl``: the quickstart's RL (the teacher's own recipe, continued from the warm start);
   - ``distill``: ``algorithm.distill`` alone (reward_weight 0): each sampled action token's
     advantage is -(log p_student - log p_teacher);
   - ``distill+reward``: the distillation term added to the GRPO advantage (reward_weight 1);
   both distillation arms without dynamic filtering (distillation learns from groups whose rewards agree);
4. repeated for ``--seeds`` seeds of the arms (the warm start and the teacher are made once).

``--student-demos N`` / ``--student-epochs E``: the arms start instead from a weaker warm start of
their own (SFT on N demonstrations x E epochs, same tokenizer, same seed), while the teacher stays the
RL-trained model made from the full warm start (or taken from ``--from-quickstart``). This is the
regime on-policy distillation is for: a student far from its teacher, whose own samples rarely earn a
reward (little signal for RL), while the teacher's per-token signal does not depend on the reward. By
default the student is the quickstart's warm start itself, which is already near its teacher.

``--teacher DIR`` (with ``--from-quickstart``): another model folder as the teacher, e.g. OUT/sft_model.

Before the arms, a probe of the teacher and the student (``first_token_probe``): the probability that a
turn opens with ``</tool_call>`` after a tool result and after a tool error (a misspelt argument name,
the student's typical slip). An RL-trained quickstart teacher answers a tool error that way, a stray
tag that is one more error; distillation teaches the student to do the same (docs/algorithms.md). The
probe runs on each arm's policy after every step too.

Prints machine info, the probe, one table (per arm: steps and RL wall time to 90% of T, per seed and
their mean; success reached), held-out success and the probe per arm, seed and step, and a final line
``distill: N.NNx fewer steps than RL to 90% of the teacher`` (mean steps of ``rl`` / mean steps of
``distill``). An arm that does not get there within ``--max-steps`` counts as ``--max-steps`` + 1 (so
the ratio is a lower bound when RL never does).
Held-out success is sampled at T=1 (``quickstart.EVAL_SAMPLES`` episodes per task), as the quickstart
measures it; its noise on 100 tasks is about 0.035.

    python benchmarks/distill.py           # the full run (tens of minutes on 2 cores)
    python benchmarks/distill.py --quick   # a smoke run (used by the test suite)
    python benchmarks/distill.py --from-quickstart runs/quickstart --student-epochs 2   # a weaker student
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from multiturn import (  # a sibling script (its folder is on sys.path)
    add_quickstart_arguments,
    budgeted_settings,
    make_env,
    own_step_loop,
    warm_starts,
)

from agent_r1.commands import quickstart
from agent_r1.models.loading import load_frozen_model, save_model
from agent_r1.models.tiny import build_tiny_tokenizer
from agent_r1.tasks import get_task
from agent_r1.train.config import config_from_dict
from agent_r1.train.sft import replay_demonstrations
from agent_r1.train.trainer import Trainer

ARMS = ("rl", "distill", "distill+reward")


def progress(message: str) -> None:
    print(f"[distill {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def arm_settings(arm: str, teacher: str | None, args, run_dir: Path, seed: int) -> dict:
    """The quickstart's RL config, with ``arm``'s algorithm section."""
    settings = budgeted_settings(argparse.Namespace(**{**vars(args), "seed": seed}), run_dir, args.threads)
    if arm != "rl":
        settings["algorithm"] = {
            **settings["algorithm"],
            "dynamic_filter": False,
            "distill": {
                "teacher": teacher,
                "coef": args.coef,
                "reward_weight": 0.0 if arm == "distill" else 1.0,
            },
        }
    return settings


def run_arm(
    arm,
    model,
    tokenizer,
    teacher,
    args,
    out: Path,
    seed: int,
    target: float | None,
    steps: int,
    states: dict[str, list[list[int]]] | None = None,
):
    """``steps`` training steps at most from ``model`` (a copy is trained), held-out evaluation after
    each, and the first-token probe on ``states`` (``probe_states``; None: no probe); stops once
    success >= ``target`` (None: never). Returns per-step rows."""
    spec = get_task("arithmetic")
    rl_tasks = spec.make_dataset(4000, split="train", seed=seed)
    heldout = spec.make_dataset(args.eval_tasks, split="test", seed=args.seed)
    config = config_from_dict(arm_settings(arm, teacher, args, out / f"{arm}_{seed}", seed))
    trainer = Trainer(
        config,
        tokenizer=tokenizer,
        model=copy.deepcopy(model),
        env_factory=lambda: make_env(tokenizer, "append"),
        train_tasks=rl_tasks,
        val_tasks=heldout,
    )
    own_step_loop(trainer, out / f"{arm}_{seed}")

    def stray_close() -> dict[str, float]:
        """The policy's p(</tool_call>) as a turn's first token in each probed state."""
        if states is None:
            return {}
        return {state: p for state, (p, _) in first_token_probe(trainer.model, tokenizer, states).items()}

    rows = [
        {"step": 0, "seconds": 0.0, "success": trainer.evaluate()["eval/success"], "stray": stray_close()}
    ]
    if target is not None:
        progress(f"{arm} seed {seed} step 0: held-out {rows[0]['success']}")
    seconds = 0.0
    if target is not None and rows[0]["success"] >= target:
        steps = 0  # the warm start is there already
    try:
        for step in range(1, steps + 1):
            trainer.step = step
            metrics = trainer.train_step(step)
            trainer.run_dir.log(step, metrics)
            seconds += metrics["time/step"]
            # the teacher's run (no target) is evaluated once, at its end
            success = trainer.evaluate()["eval/success"] if target is not None or step == steps else None
            rows.append(
                {
                    "step": step,
                    "seconds": seconds,
                    "success": success,
                    "reverse_kl": metrics.get("distill/reverse_kl"),
                    "teacher_s": metrics.get("time/teacher", 0.0),
                    "stray": stray_close(),
                }
            )
            progress(
                f"{arm} seed {seed} step {step}: held-out {success}"
                + (
                    f", reverse KL {metrics['distill/reverse_kl']:.3f}"
                    if "distill/reverse_kl" in metrics
                    else ""
                )
                + "".join(f", p(</tool_call>) {state} {p:.3f}" for state, p in rows[-1]["stray"].items())
            )
            if target is not None and success >= target:
                break
    finally:
        trainer.run_dir.close()
        trainer.close()
    return rows, trainer.model


def probe_states(tokenizer, tasks: int, seed: int) -> dict[str, list[list[int]]]:
    """The prompts (token ids) of a turn after a tool result and after a tool error, one per task.

    The quickstart task's demonstrations replayed through its env, with the first tool call intact
    (a tool result follows) or with its argument name misspelt (the tool's error follows), the typo a
    sampled student makes; each state is the second turn's prompt.
    """
    spec = get_task("arithmetic")
    held_out = spec.make_dataset(tasks, split="test", seed=seed)

    def misspelt(task, rng):
        first, *rest = spec.demonstrate(task, rng)
        if '"expression"' not in first:
            raise ValueError(f"the demonstrator's first call changed, nothing to misspell in {first!r}")
        return [first.replace('"expression"', '"expressi4n"'), *rest]

    return {
        name: [
            t.steps[1].prompt_ids
            for t in replay_demonstrations(
                lambda: make_env(tokenizer, "append"), tokenizer, held_out, demonstrate, seed=seed
            )
        ]
        for name, demonstrate in (("after a tool result", spec.demonstrate), ("after a tool error", misspelt))
    }


def first_token_probe(model, tokenizer, states: dict[str, list[list[int]]]) -> dict[str, tuple[float, str]]:
    """What ``model`` writes first in a turn in each of ``states`` (``probe_states``): the mean
    probability of ``</tool_call>`` as the first token, and the most common most likely first token.

    An RL-trained quickstart teacher answers a tool error with ``</tool_call>`` (a stray closing tag:
    another error, and so on to the turn limit) and teaches that to a student that makes such errors.
    The model is run in eval mode and left in the mode it was in.
    """
    close_id = tokenizer.convert_tokens_to_ids("</tool_call>")
    training = model.training
    model.eval()
    out: dict[str, tuple[float, str]] = {}
    try:
        with torch.no_grad():
            for state, prompts in states.items():
                probs = [model(torch.tensor([ids])).logits[0, -1].float().softmax(-1) for ids in prompts]
                p_close = statistics.mean(float(p[close_id]) for p in probs)
                top = statistics.mode(tokenizer.decode([int(p.argmax())]) for p in probs)
                out[state] = (p_close, top)
    finally:
        model.train(training)
    return out


def trainable(model):
    """A loaded model as the trainer takes one (its Learner optimises the parameters that need grads)."""
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return model.train()


def reached(rows: list[dict], target: float, max_steps: int) -> tuple[int, float | None]:
    """The first step whose held-out success >= target and the RL seconds to it (max_steps + 1, None: never)."""
    for row in rows:
        if row["success"] >= target:
            return row["step"], row["seconds"]
    return max_steps + 1, None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_quickstart_arguments(parser)
    parser.add_argument("--teacher-steps", type=int, default=12, help="RL steps that make the teacher")
    parser.add_argument("--max-steps", type=int, default=12, help="the most steps per arm")
    parser.add_argument("--seeds", type=int, default=2, help="seeds of the arms")
    parser.add_argument(
        "--first-arm-seed", type=int, default=None, help="the arms' first seed (default --seed + 1)"
    )
    parser.add_argument("--coef", type=float, default=1.0, help="algorithm.distill.coef")
    parser.add_argument(
        "--from-quickstart",
        metavar="OUT",
        help="take the student and the teacher from a finished `agent-r1 quickstart --out OUT`: "
        "OUT/sft_model and the last checkpoint's model in OUT/run/checkpoints (skips both making them)",
    )
    parser.add_argument(
        "--teacher",
        metavar="DIR",
        help="with --from-quickstart: this model folder is the teacher instead of the last checkpoint's "
        "(e.g. OUT/sft_model, a teacher that was never RL-trained)",
    )
    parser.add_argument(
        "--student-demos",
        type=int,
        default=None,
        help="start the arms from a weaker warm start of their own: SFT on this many demonstrations "
        "(default: the arms start from the teacher's own warm start)",
    )
    parser.add_argument(
        "--student-epochs",
        type=int,
        default=None,
        help="epochs of that weaker warm start (default --sft-epochs; either flag makes one)",
    )
    parser.add_argument(
        "--arms",
        default=",".join(ARMS),
        help="the arms to run, comma-separated, in this order (default all: %(default)s); the closing "
        "ratio needs rl and distill",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.teacher and not args.from_quickstart:
        parser.error("--teacher needs --from-quickstart (without it the script trains its own teacher)")
    arms = tuple(arm.strip() for arm in args.arms.split(","))
    if unknown := [arm for arm in arms if arm not in ARMS]:
        parser.error(f"--arms: unknown {', '.join(unknown)} (known: {', '.join(ARMS)})")
    if args.quick:
        args.sft_demos, args.sft_epochs, args.eval_tasks = 64, 1, 4
        args.tasks_per_step, args.group_size = 2, 2
        args.teacher_steps, args.max_steps, args.seeds = 1, 1, 1

    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    tokenizer = build_tiny_tokenizer()
    results: dict[str, list] = {arm: [] for arm in arms}
    with tempfile.TemporaryDirectory(prefix="distill_") as tmp:
        out = Path(tmp)
        if args.from_quickstart:
            given = Path(args.from_quickstart)
            student = trainable(load_frozen_model(given / "sft_model", key="--from-quickstart"))
            teacher_dir = args.teacher or str(
                sorted((given / "run" / "checkpoints").glob("step_*"))[-1] / "model"
            )
            progress(f"student {given / 'sft_model'}, teacher {teacher_dir}")
            made = f"from {given}: warm start its sft_model, teacher {teacher_dir}"
            before_rows, _ = run_arm(
                "rl", student, tokenizer, None, args, out / "student", args.seed, None, 0
            )
            teacher_model = trainable(load_frozen_model(teacher_dir, key="--from-quickstart"))
            teacher_rows, _ = run_arm(
                "rl", teacher_model, tokenizer, None, args, out / "teacher", args.seed, None, 0
            )
            teacher_rows = [before_rows[0], teacher_rows[0]]
        else:
            progress(f"warm start: {args.sft_demos} demonstrations x {args.sft_epochs} epochs")
            student = warm_starts(tokenizer, args, contexts=("append",))["append"][0]
            made = f"SFT {args.sft_demos} demos x {args.sft_epochs} epochs; teacher = student + {args.teacher_steps} RL steps"
            progress(f"teacher: {args.teacher_steps} RL steps")
            teacher_rows, teacher_model = run_arm(
                "rl", student, tokenizer, None, args, out / "teacher", args.seed, None, args.teacher_steps
            )
            teacher_dir = str(save_model(teacher_model, tokenizer, out / "teacher_model"))
        warm_success = teacher_rows[0]["success"]
        if args.student_demos is not None or args.student_epochs is not None:
            weak = argparse.Namespace(
                **{
                    **vars(args),
                    "sft_demos": args.sft_demos if args.student_demos is None else args.student_demos,
                    "sft_epochs": args.sft_epochs if args.student_epochs is None else args.student_epochs,
                }
            )
            progress(f"weaker student: {weak.sft_demos} demonstrations x {weak.sft_epochs} epochs")
            student = warm_starts(tokenizer, weak, contexts=("append",))["append"][0]
            made += f"; student its own SFT: {weak.sft_demos} demos x {weak.sft_epochs} epochs"
        states = probe_states(tokenizer, args.eval_tasks, args.seed)
        probe = {
            "teacher": first_token_probe(load_frozen_model(teacher_dir, key="teacher"), tokenizer, states),
            "student": first_token_probe(student, tokenizer, states),
        }
        teacher_success = teacher_rows[-1]["success"]
        target = 0.9 * teacher_success
        progress(f"teacher held-out success {teacher_success:.3f}; target {target:.3f}")
        first = args.seed + 1 if args.first_arm_seed is None else args.first_arm_seed
        for seed in range(first, first + args.seeds):
            for arm in arms:
                rows, _ = run_arm(
                    arm, student, tokenizer, teacher_dir, args, out, seed, target, args.max_steps, states
                )
                results[arm].append(rows)

    print(
        f"machine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
        f"torch {torch.__version__}, threads {torch.get_num_threads()}, load {os.getloadavg()[0]:.2f}"
    )
    student_success = results[arms[0]][0][0]["success"]
    print(
        f"task: quickstart arithmetic; {made}; teacher held-out success {teacher_success:.3f} (its warm "
        f"start {warm_success:.3f}; the arms' student {student_success:.3f}), target 0.9 x = {target:.3f}; "
        f"{args.tasks_per_step} tasks x "
        f"{args.group_size} samples per step; held-out {args.eval_tasks} tasks x {quickstart.EVAL_SAMPLES} "
        f"sampled; {args.seeds} seeds; at most {args.max_steps} steps per arm"
    )
    for model_name, states in probe.items():
        print(
            f"{model_name} first token "
            + "; ".join(
                f"{state}: p(</tool_call>) {p:.2f}, most likely {top!r}" for state, (p, top) in states.items()
            )
        )
    print(
        f"| {'arm':<15} | {'steps to 90% (per seed)':<24} | {'mean':>5} | {'RL s to 90%':>12} | {'best success':>12} |"
    )
    print(f"|{'-' * 17}|{'-' * 26}|{'-' * 7}|{'-' * 14}|{'-' * 14}|")
    mean_steps = {}
    for arm in arms:
        hits = [reached(rows, target, args.max_steps) for rows in results[arm]]
        steps = [s for s, _ in hits]
        mean_steps[arm] = statistics.mean(steps)
        per_seed = ", ".join(str(s) if s <= args.max_steps else f">{args.max_steps}" for s in steps)
        timed = [t for _, t in hits if t is not None]
        seconds = f"{statistics.mean(timed):.0f}" if timed else "-"
        best = statistics.mean(max(r["success"] for r in rows) for rows in results[arm])
        print(f"| {arm:<15} | {per_seed:<24} | {mean_steps[arm]:>5.2f} | {seconds:>12} | {best:>12.3f} |")
    print("per step from step 0 (held-out success; p(</tool_call>) as a turn's first token, policy):")
    for arm in arms:
        for offset, rows in enumerate(results[arm]):
            seed = first + offset
            line = " ".join(f"{r['success']:.3f}" for r in rows)
            for state in rows[0]["stray"]:
                line += f"; {state} " + " ".join(f"{r['stray'][state]:.3f}" for r in rows)
            print(f"  {arm} seed {seed}: {line}")
    print(f"total wall time {time.perf_counter() - started:.0f}s")
    if "rl" not in mean_steps or "distill" not in mean_steps:
        print("distill: n/a: the ratio needs the rl and distill arms")
    elif mean_steps["distill"] == 0:
        print("distill: n/a: the warm start already reaches 90% of the teacher (make the teacher stronger)")
    else:
        ratio = mean_steps["rl"] / mean_steps["distill"]
        print(f"distill: {ratio:.2f}x fewer steps than RL to 90% of the teacher")


if __name__ == "__main__":
    main()
