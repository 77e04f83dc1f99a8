"""``agent-r1 train CONFIG [key=value ...] [--resume]``: RL-train a policy from a YAML config.

Exit codes: 0 trained; 2 a configuration, data, model or checkpoint error, a checkpoint or run
directory that cannot be written (a full disk), or a refused resume (no checkpoint, or a changed
config: see ``agent_r1.train.resume``); 3 stopped by the error budget
(``trainer.max_error_fraction``: too many trajectories of a step ended in ERROR); 4 preempted by
SIGTERM / SIGINT, checkpoint written (``--resume`` continues); 5 preempted, but the checkpoint could
not be written within ``trainer.preemption_grace_s`` (the previous one stands):
``agent_r1.train.preemption``."""

from __future__ import annotations

import argparse
import errno

# A full disk, a quota, a read-only or unwritable run directory: reported in one line, not a traceback.
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM}

HELP = "RL-train a policy: agent-r1 train CONFIG.yaml [section.key=value ...] [--resume]"
EPILOG = (
    "exit codes: 0 trained; 2 configuration, data, model or checkpoint error, an unwritable run "
    "directory (a full disk), or a refused resume; "
    "3 stopped by the error budget; 4 preempted by SIGTERM/SIGINT after writing a checkpoint "
    "(--resume continues); 5 preempted, no checkpoint within trainer.preemption_grace_s (the previous "
    "one stands)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/training.md and configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. trainer.steps=50 algorithm.kl.coef=0.01",
    )
    resume = parser.add_mutually_exclusive_group()
    resume.add_argument(
        "--resume",
        action="store_const",
        const=True,
        default=False,
        help="continue from the newest checkpoint in trainer.run_dir that verifies (exact data order, "
        "RNG, step); refused when there is none or when the config differs from RUN_DIR/config.yaml",
    )
    resume.add_argument(
        "--resume-or-start",
        dest="resume",
        action="store_const",
        const="auto",
        help="like --resume, but start a fresh run when trainer.run_dir holds no checkpoint",
    )
    resume.add_argument(
        "--resume-from",
        dest="resume",
        metavar="CHECKPOINT",
        help="continue from this checkpoint folder (e.g. RUN_DIR/checkpoints/best, the best evaluation's) "
        "instead of the newest; the run directory's newer checkpoints are set aside as superseded-step_N",
    )
    resume.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a trainer.run_dir that holds an earlier run: deletes its checkpoints, "
        "metrics.jsonl, trajectories/ and tb/ (without a flag such a run directory is refused)",
    )
    parser.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume even though the config differs from the run's config.yaml (which is then kept as "
        "config.prev-N.yaml)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar (same as logging.progress=false)"
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a recipe's whole pipeline in a minute on a CPU: its data command, env and reward, 2 steps, "
        "with a tiny stand-in model of the same family, in TRAINER.RUN_DIR-smoke (docs/recipes.md)",
    )


def run(args: argparse.Namespace) -> int:
    from agent_r1.train.checkpoint import CheckpointError
    from agent_r1.train.config import load_config_with_choices
    from agent_r1.train.health import TrainingHalted
    from agent_r1.train.preemption import PREEMPTED_EXIT, Preempted
    from agent_r1.train.preflight import PREFLIGHT_ERRORS
    from agent_r1.train.resume import ResumeError

    overrides = list(args.overrides) + (["logging.progress=false"] if args.quiet else [])
    try:
        config, choices = load_config_with_choices(args.config, overrides)
        for choice in choices:  # what trainer.mode: async needs, where the config left it unset
            print(f"agent-r1 train: chose {choice}")
        from agent_r1.train.builders import precision_line

        precision = precision_line(config)
        if precision:  # model.compute_dtype / rollout.compute_dtype other than float32
            print(f"agent-r1 train: {precision}")
        if args.smoke:
            from agent_r1.train.smoke import SmokeError, smoke_config

            try:
                config = smoke_config(config, args.config)
            except SmokeError as e:
                print(f"agent-r1 train --smoke: {e}")
                return 2
        from agent_r1.train.preflight import preflight

        preflight(config)  # agent-r1 check: every mistake found without the weights, before they load
        from agent_r1.train.trainer import Trainer

        trainer = Trainer(
            config,
            resume=args.resume,
            allow_config_change=args.allow_config_change,
            overwrite=args.overwrite or args.smoke,  # a smoke folder is rebuilt each time
        )
    except (*PREFLIGHT_ERRORS, FileNotFoundError, ResumeError, CheckpointError) as e:
        print(f"agent-r1 train: {e}")
        return 2
    try:
        metrics = trainer.fit()
    except TrainingHalted as e:
        print(f"agent-r1 train: stopped: {e}")
        return 3
    except Preempted as e:
        print(f"agent-r1 train: {e}", flush=True)
        return PREEMPTED_EXIT
    except CheckpointError as e:  # a checkpoint that could not be written: full disk, unwritable dir
        print(f"agent-r1 train: {e}")
        return 2
    except OSError as e:
        if e.errno not in _DISK_ERRNOS:
            raise
        print(
            f"agent-r1 train: cannot write the run directory {config.trainer.run_dir} ({e}); the "
            "checkpoints already written are intact: free space or fix permissions, then --resume"
        )
        return 2
    summary = {
        k: metrics[k] for k in ("reward/mean", "success/mean", "eval/reward", "eval/success") if k in metrics
    }
    print(
        f"done: {config.trainer.steps} steps in {config.trainer.run_dir}  "
        + "  ".join(f"{k}={v:.3f}" for k, v in summary.items())
    )
    return 0
