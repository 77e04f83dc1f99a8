"""``agent-r1 eval CONFIG [key=value ...] [--checkpoint DIR]``: mean reward and success on data.val.

Prints the metrics as one JSON line; what the config chose for you (what ``trainer.mode: async``
needs, where you left it unset) goes to stderr, one ``agent-r1 eval: chose ...`` line each.

Exit codes: 0 evaluated; 2 configuration or data errors (every one found, one per line); 3 too many
evaluation trajectories ended in ERROR (``trainer.max_error_fraction``)."""

from __future__ import annotations

import argparse
import json
import sys

HELP = "Evaluate a policy on the config's validation tasks: agent-r1 eval CONFIG.yaml [--checkpoint DIR]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="YAML config file (the same one used for training)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides")
    parser.add_argument(
        "--checkpoint",
        default=None,
        help="a checkpoint folder (RUN_DIR/checkpoints/step_N) whose policy to evaluate; "
        "default: model.path as configured",
    )


def run(args: argparse.Namespace) -> int:
    from agent_r1.train.checkpoint import CheckpointError
    from agent_r1.train.config import load_config_with_choices
    from agent_r1.train.health import TrainingHalted
    from agent_r1.train.preflight import PREFLIGHT_ERRORS

    try:
        config, choices = load_config_with_choices(args.config, list(args.overrides))
        for choice in choices:
            print(f"agent-r1 eval: chose {choice}", file=sys.stderr)
        from agent_r1.train.evaluation import evaluate
        from agent_r1.train.preflight import preflight

        preflight(config, splits=("data.val",))  # agent-r1 check's checks, before the weights load

        model = own_models = None
        if args.checkpoint:
            from agent_r1.train.builders import load_own_models
            from agent_r1.train.checkpoint import load_checkpoint
            from agent_r1.train.policies import policy_model

            model = policy_model(config)  # with several policies, an adapter each
            own_models = load_own_models(config)  # and the policies with a model of their own
            trained = {name: m for name, m in own_models.items() if not config.policies[name].frozen}
            load_checkpoint(args.checkpoint, model, own_models=trained)
        metrics = evaluate(config, model=model, own_models=own_models)
    except (*PREFLIGHT_ERRORS, FileNotFoundError, CheckpointError) as e:
        print(f"agent-r1 eval: {e}")
        return 2
    except TrainingHalted as e:
        print(f"agent-r1 eval: stopped: {e}")
        return 3
    print(json.dumps(metrics))
    return 0
