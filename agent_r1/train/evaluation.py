"""Evaluation: the policy's mean reward and success rate on the validation tasks, written once and
used by the trainer (``Trainer.evaluate``, with its own rollout backend) and by ``agent-r1 eval``
(``evaluate``, which builds only the rollout side: no learner, no optimizer, no reference)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from agent_r1.flows.base import AgentFlow
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import config_tasks
from agent_r1.train.health import rollout_health
from agent_r1.train.summary import RewardFn, evaluation_metrics, score_groups
from agent_r1.types import Task

__all__ = ["evaluate", "evaluate_rollouts"]


def evaluate_rollouts(
    rollouts,
    tasks: Sequence[Task],
    config: TrainConfig,
    step: int,
    *,
    reward_fn: RewardFn | None = None,
) -> dict[str, float]:
    """``rollout.eval_n`` samples of every task on a rollout backend's evaluation flow, seeded by
    (seed, step): ``eval/reward``, ``eval/success`` (an ERROR trajectory counts as 0),
    ``eval/error_fraction``, ``eval/tasks``, ``eval/episodes`` (tasks x eval_n, an episode of several
    roles counted once) and ``eval/trajectories`` (one per role of each episode), within the error
    budget (``rollout_health``: too many errors raise)."""
    base = f"{config.trainer.seed}:eval:{step}"
    groups = rollouts.collect(rollouts.submit(tasks, config.rollout.eval_n, base, evaluation=True))
    halt = rollout_health(groups, config.trainer.max_error_fraction, f"evaluation at step {step}")
    if halt is not None:
        raise halt
    return evaluation_metrics(score_groups(groups, tasks, reward_fn))


def evaluate(
    config: TrainConfig,
    *,
    tokenizer=None,
    model=None,
    engine=None,
    env_factory: Callable[[], Any] | None = None,
    eval_flow: AgentFlow | None = None,
    val_tasks: Any = None,
    reward_fn: RewardFn | None = None,
    own_models: dict | None = None,
) -> dict[str, float]:
    """Evaluate the configured policy (``model``, or ``model.path``) on ``data.val`` and return
    eval/reward, eval/success, eval/error_fraction, eval/tasks, eval/episodes, eval/trajectories
    (``evaluate_rollouts``). A saved adapter (``model.adapter``) is held as train holds it, so this
    equals train's step-0 evaluation. With several policies,
    ``own_models``: the policies with a model of their own (default: loaded from their paths)."""
    from agent_r1.train.backends import local_rollout
    from agent_r1.train.builders import check_env, load_config_tokenizer, resolve_device

    if env_factory is None and eval_flow is None:
        check_env(config)  # before the tokenizer and the model load
    if tokenizer is None:
        tokenizer = load_config_tokenizer(config)
    if val_tasks is None and not config.data.val:
        raise ConfigError("data.val", "no validation tasks to evaluate on")
    tasks = config_tasks(config, val_tasks, "data.val")
    if not tasks:
        raise ConfigError("data.val", "no validation tasks to evaluate on")
    device = resolve_device(config)
    if engine is None and model is None and config.model.adapter and config.rollout.engine == "hf":
        from agent_r1.train.policies import policy_model

        model = policy_model(config)  # the saved adapter on the base, held as train holds it
    if engine is None and config.policies:
        from agent_r1.train.builders import load_own_models
        from agent_r1.train.policies import policy_model

        if model is None:
            model = policy_model(config)  # every policy's adapter on the base: each role its own
        if own_models is None:
            own_models = load_own_models(config, tokenizer=tokenizer)
        own_models = {name: m.to(device) for name, m in own_models.items()}
    if model is not None and engine is None:
        model = model.to(device)
    rollouts = local_rollout(
        config,
        tokenizer,
        model=model,
        engine=engine,
        flow=eval_flow,
        eval_flow=eval_flow,
        make_env=env_factory,
        device=device,
        own_models=own_models,
    )
    try:
        return evaluate_rollouts(rollouts, tasks, config, 0, reward_fn=reward_fn)
    finally:
        rollouts.close()
