"""``agent-r1 train CONFIG [key=value ...] [--resume]``: RL-train a policy from a YAML config."""

from __future__ import annotations

import argparse

HELP = "RL-train a policy: agent-r1 train CONFIG.yaml [section.key=value ...] [--resume]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (see docs/training.md and configs/)")
    parser.add_argument(
        "overrides",
        nargs="*",
        metavar="key=value",
        help="dotted overrides, e.g. trainer.steps=50 algorithm.kl_coef=0.01",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in trainer.run_dir (exact data order, RNG, step)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar (same as logging.progress=false)"
    )


def run(args: argparse.Namespace) -> int:
    from agent_r1.train.config import ConfigError, load_config
    from agent_r1.train.data import DataError

    overrides = list(args.overrides) + (["logging.progress=false"] if args.quiet else [])
    try:
        config = load_config(args.config, overrides)
        if config.distributed.backend == "ray":
            from agent_r1.distributed.driver import RayTrainer as Trainer
        else:
            from agent_r1.train.trainer import Trainer

        trainer = Trainer(config, resume=args.resume)
    except (ConfigError, DataError, FileNotFoundError) as e:
        print(f"agent-r1 train: {e}")
        return 2
    metrics = trainer.fit()
    summary = {
        k: metrics[k] for k in ("reward/mean", "success/mean", "eval/reward", "eval/success") if k in metrics
    }
    print(
        f"done: {config.trainer.steps} steps in {config.trainer.run_dir}  "
        + "  ".join(f"{k}={v:.3f}" for k, v in summary.items())
    )
    return 0
