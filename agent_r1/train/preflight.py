"""``preflight(config)``: everything about a run that can be checked without the model's weights, in
seconds. ``agent-r1 check`` prints its report; ``agent-r1 train`` and ``agent-r1 eval`` run it
first, so that a mistake surfaces before the model loads, not at the step-0 evaluation.

In order, each failure one of ``PREFLIGHT_ERRORS`` naming the key, the file and the row:

1. the devices and the attention kernel (``model.device``, ``model.attn_implementation``);
2. ``env.name`` imported and ``env.kwargs`` checked by the env's ``check_kwargs`` (the import paths
   it names: an agent program's agent and reward, a Gymnasium id and text hook, a TextArena game and
   scripted opponent);
3. the model found: ``model.tokenizer`` / ``model.path`` a local folder (a relative path: from the
   working directory, else from the config file's folder, ``load_config``) or a Hub name; when the
   Hub cannot be reached, the process goes offline (``go_offline``) and a name missing from the
   local cache fails at once instead of after a minute of retries; each ``policies.<name>.adapter``
   a LoRA adapter folder that peft saved (``agent_r1.train.policies.check_adapters``);
4. the tokenizer loaded (no weights) and its chat template present; each ``policies.<name>.path`` a
   model folder whose tokenizer is the run's (``agent_r1.train.policies.check_own_models``);
5. every row of ``data.train`` and ``data.val``: ``data.required_fields``, the env's
   ``required_fields``, and no field the env does not read (its ``task_fields``);
6. the env built with the tokenizer and reset on the first row of ``data.train`` and of
   ``data.val``, and the first prompt rendered to token ids (an env whose ``reset`` runs the model,
   ``reset_calls_policy``, is built but not reset); with several policies, the role of that first
   prompt is played by one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from pathlib import Path
from typing import Any

from agent_r1.models.loading import ModelNotFoundError, NoChatTemplateError
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import DataError, config_tasks

__all__ = ["PREFLIGHT_ERRORS", "preflight"]

# A Hugging Face Hub name ("gpt2", "Org/name"); any other value that is no folder is a missing folder.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def preflight(config: TrainConfig, *, splits: tuple[str, ...] = ("data.train", "data.val")) -> list[str]:
    """Check ``config`` without loading weights (module docstring); return one line per check
    passed. ``splits``: the data keys to read, each required ("data.val" is skipped when unset
    unless it is the only one, as for ``agent-r1 eval``)."""
    from agent_r1.train.builders import (
        check_attention,
        check_env,
        load_config_tokenizer,
        resolve_device,
    )
    from agent_r1.train.policies import check_adapters, check_own_models, what_loads

    report = [f"device: {resolve_device(config)}"]
    check_attention(config)
    check_env(config)
    report.append(f"env.name {config.env.name!r}: imported; env.kwargs {sorted(config.env.kwargs)} checked")
    key = _check_model_source(config)
    check_adapters(config)
    tokenizer = load_config_tokenizer(config)
    report.append(f"{key} {getattr(config.model, key.split('.')[1])!r}: tokenizer and chat template loaded")
    report += [
        f"policies.{name}.adapter {policy.adapter!r}: a LoRA adapter folder"
        for name, policy in config.policies.items()
        if policy.adapter is not None
    ]
    check_own_models(config, tokenizer)
    report += [
        f"policies.{name}.path {policy.path!r}: a model folder with the run's tokenizer"
        for name, policy in config.policies.items()
        if policy.path is not None
    ]
    report += what_loads(config)
    tasks = {}
    for split in splits:
        if split == "data.val" and not config.data.val and len(splits) > 1:
            continue
        tasks[split] = config_tasks(config, None, split)
        if not tasks[split]:
            raise DataError(f"{split}: {getattr(config.data, split.split('.')[1])}: no rows")
        report.append(f"{split}: {len(tasks[split])} rows, fields checked")
    report += _check_env_resets(config, tokenizer, tasks)
    return report


def _check_model_source(config: TrainConfig) -> str:
    """The key the tokenizer loads from, checked (and ``model.path``, the weights, when the tokenizer
    comes from elsewhere) to be a folder or a Hub name that can be loaded."""
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    if not (config.model.tokenizer or config.model.path):
        raise ConfigError("model.path", "no model given: set model.path")
    _check_source(key, config.model.tokenizer or config.model.path)
    if config.model.path and key != "model.path":
        _check_source("model.path", config.model.path)
    return key


def _check_source(key: str, value: str) -> None:
    from agent_r1.models.loading import go_offline, hub_reachable, in_hub_cache

    path = Path(value).expanduser()
    if path.is_dir():
        return
    named = (
        f"{key} = {value!r} is not a local folder (a relative path is taken from the working "
        f"directory, {Path.cwd()}, else from the config file's folder)"
    )
    if path.exists():
        raise ModelNotFoundError(f"{key} = {value!r} is a file; give the model's folder")
    if not _HUB_NAME.fullmatch(value):
        raise ModelNotFoundError(f"{named}, nor a Hugging Face Hub name: give the model's folder")
    if not hub_reachable():
        go_offline()
        if not in_hub_cache(value):
            from huggingface_hub import constants

            raise ModelNotFoundError(
                f"{named}, and as a Hugging Face Hub name it is not in the local cache "
                f"({constants.HF_HUB_CACHE}) while the Hub ({constants.ENDPOINT}) cannot be reached: give "
                f"the model's folder, or download it beforehand (hf download {value})"
            )


def _check_env_resets(config: TrainConfig, tokenizer, tasks: dict[str, list[dict]]) -> list[str]:
    """The env built, and reset on the first row of each split, its first prompt tokenised."""
    from agent_r1.envs.registry import get_env_factory
    from agent_r1.train.builders import env_factory

    if not config.env.name:
        return []
    build = env_factory(config, tokenizer)
    if getattr(get_env_factory(config.env.name), "reset_calls_policy", False):
        env = build()  # construction errors name env.kwargs; reset needs the model
        _check_roles(config, env.episode_roles() or (), f"env {config.env.name!r}")
        return [f"env {config.env.name!r}: built (its reset runs the model: not reset here)"]
    report = []
    for split, rows in tasks.items():
        env = build()
        source = getattr(config.data, split.split(".")[1])
        n_prompt = asyncio.run(_reset_once(env, rows[0], tokenizer, f"{split}: {source}: row 0", config))
        report.append(f"env {config.env.name!r}: built and reset on {split} row 0 ({n_prompt} prompt tokens)")
    return report


async def _reset_once(env, row: dict[str, Any], tokenizer, where: str, config: TrainConfig) -> int:
    from agent_r1.models.tokens import observation_ids
    from agent_r1.types import StepResult

    ident = f" (id {row['id']!r})" if "id" in row else ""
    try:
        observation = await env.reset(row)
        if isinstance(observation, StepResult):  # the episode ended before the first action
            return 0
        n_prompt = len(observation_ids(observation, tokenizer))
    except Exception as error:
        raise DataError(
            f"{where}{ident}: env {config.env.name!r} (env.kwargs {sorted(config.env.kwargs)}) could not "
            f"start an episode: {type(error).__name__}: {error} (fix the row or env.kwargs)"
        ) from None
    finally:
        with contextlib.suppress(Exception):  # a failing close must not hide the reset's error
            await env.close()
    # the first role to act, and every role the env names, is played by a configured policy
    _check_roles(config, [observation.role, *(env.episode_roles() or ())], f"{where}{ident}")
    return n_prompt


def _check_roles(config: TrainConfig, roles, where: str) -> None:
    """Each of ``roles`` (None: the episode has one) is played by a configured policy, with several
    policies: a ``ConfigError`` naming ``where`` otherwise."""
    from agent_r1.train.policies import policy_of

    if not config.policies:
        return
    for role in dict.fromkeys(roles):
        try:
            policy_of(config, role)
        except ConfigError as error:
            raise ConfigError(error.key, f"{where}: {error.why}") from None


PREFLIGHT_ERRORS = (ConfigError, DataError, ModelNotFoundError, NoChatTemplateError)
"""What ``preflight`` raises: each a message for people that names the key, printed once, exit 2."""
