"""``preflight(config)``: everything about a run that can be checked without the model's weights, in
seconds. ``agent-r1 check`` prints its report; ``agent-r1 train`` and ``agent-r1 eval`` run it
first, so that a mistake surfaces before the model loads, not at the step-0 evaluation.

Each failure is one of ``PREFLIGHT_ERRORS`` naming the key, the file and the row. A failed check does
not stop the others: every independent check runs and every failure is raised together (one as
itself, several as ``PreflightErrors``); a check that needs one that failed (the tokenizer needs the
model folder, an env reset needs the env, the tokenizer and the rows) is skipped. The checks:

1. the devices and the attention kernel (``model.device``, ``model.attn_implementation``), and
   ``rollout.engine_kwargs`` against the arguments of ``rollout.engine``
   (``agent_r1.train.builders.check_engine_kwargs``);
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
   ``required_fields``, and no field the env does not read (its ``task_fields``; when the env failed,
   the rows are still read and ``data.required_fields`` checked);
6. the env built with the tokenizer and reset on the first row of ``data.train`` and of
   ``data.val``, and the first prompt rendered to token ids (an env whose ``reset`` runs the model,
   ``reset_calls_policy``, is built but not reset); with several policies, the role of that first
   prompt is played by one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from agent_r1.models.loading import ModelNotFoundError, NoChatTemplateError
from agent_r1.train.config import ConfigError, ConfigErrors, TrainConfig
from agent_r1.train.data import DataError, config_tasks

__all__ = ["PREFLIGHT_ERRORS", "PreflightErrors", "preflight"]

# A Hugging Face Hub name ("gpt2", "Org/name"); any other value that is no folder is a missing folder.
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class PreflightErrors(ValueError):
    """Several independent problems found by one ``preflight`` (``errors``, each one of
    ``PREFLIGHT_ERRORS``, in the order found), listed one per line."""

    def __init__(self, errors: Sequence[Exception]) -> None:
        super().__init__(f"{len(errors)} problems")
        self.errors = list(errors)

    def __str__(self) -> str:
        return f"{len(self.errors)} problems found without the weights:\n" + "\n".join(
            f"  {e}" for e in self.errors
        )


class _Findings:
    """What ``preflight`` found: one line per check passed, and every failure."""

    def __init__(self) -> None:
        self.report: list[str] = []
        self.errors: list[Exception] = []

    def run(self, check: Callable[..., Any], *args: Any) -> tuple[bool, Any]:
        """``(True, check(*args))``, or ``(False, None)`` with the failure recorded (the failures of a
        ``ConfigErrors`` one by one, each message once: the env built for each split fails alike)."""
        try:
            return True, check(*args)
        except _CHECK_ERRORS as error:
            said = {str(e) for e in self.errors}
            for e in error.errors if isinstance(error, ConfigErrors) else [error]:
                if str(e) not in said:
                    self.errors.append(e)
            return False, None

    def raise_all(self) -> None:
        """Raise the failures: one as itself; several as ``ConfigErrors`` when each is a
        ``ConfigError`` (still one for its callers), else as ``PreflightErrors``."""
        if all(isinstance(e, ConfigError) for e in self.errors):
            ConfigErrors.raise_all(self.errors)
        elif len(self.errors) == 1:
            raise self.errors[0]
        else:
            raise PreflightErrors(self.errors)


def preflight(config: TrainConfig, *, splits: tuple[str, ...] = ("data.train", "data.val")) -> list[str]:
    """Check ``config`` without loading weights (module docstring); return one line per check
    passed, or raise every failure at once. ``splits``: the data keys to read, each required
    ("data.val" is skipped when unset unless it is the only one, as for ``agent-r1 eval``)."""
    from agent_r1.train.builders import (
        check_attention,
        check_engine_kwargs,
        check_env,
        compute_dtype,
        load_config_tokenizer,
        resolve_device,
        sampler_dtype,
    )
    from agent_r1.train.policies import check_adapters, check_own_models, what_loads

    found = _Findings()
    ok, device = found.run(resolve_device, config)
    if ok:
        found.report.append(f"device: {device}")
        _, why = compute_dtype(config, device)
        found.report.append(f"model.compute_dtype {config.model.compute_dtype!r}: {why}")
        _, why = sampler_dtype(config, device)
        found.report.append(f"rollout.compute_dtype {config.rollout.compute_dtype!r}: {why}")
    found.run(check_attention, config)
    ok, line = found.run(check_engine_kwargs, config)
    if ok:
        found.report.append(line)
    env_ok, _ = found.run(check_env, config)
    if env_ok:
        found.report.append(
            f"env.name {config.env.name!r}: imported; env.kwargs {sorted(config.env.kwargs)} checked"
        )
    model_ok, key = found.run(_check_model_source, config)
    adapters_ok, _ = found.run(check_adapters, config)
    tokenizer_ok, tokenizer = found.run(load_config_tokenizer, config) if model_ok else (False, None)
    if tokenizer_ok:
        found.report.append(
            f"{key} {getattr(config.model, key.split('.')[1])!r}: tokenizer and chat template loaded"
        )
    if adapters_ok:
        found.report += [
            f"policies.{name}.adapter {policy.adapter!r}: a LoRA adapter folder"
            for name, policy in config.policies.items()
            if policy.adapter is not None
        ]
    own_ok, _ = found.run(check_own_models, config, tokenizer) if tokenizer_ok else (False, None)
    if own_ok:
        found.report += [
            f"policies.{name}.path {policy.path!r}: a model folder with the run's tokenizer"
            for name, policy in config.policies.items()
            if policy.path is not None
        ]
    if adapters_ok and own_ok:
        ok, loads = found.run(what_loads, config)
        found.report += loads if ok else []
    # the rows are read even when the env failed; only the fields it declares then go unchecked
    rows_config = config if env_ok else replace(config, env=replace(config.env, name=""))
    tasks = {}
    for split in splits:
        if split == "data.val" and not config.data.val and len(splits) > 1:
            continue
        ok, rows = found.run(_rows, rows_config, split)
        if ok:
            tasks[split] = rows
            found.report.append(f"{split}: {len(rows)} rows, fields checked")
    if env_ok and tokenizer_ok:
        found.report += _check_env_resets(config, tokenizer, tasks, found)
    found.raise_all()
    return found.report


def _rows(config: TrainConfig, split: str) -> list[dict]:
    """The rows of ``split`` (``data.train`` or ``data.val``), checked (``config_tasks``), at least one."""
    rows = config_tasks(config, None, split)
    if not rows:
        raise DataError(f"{split}: {getattr(config.data, split.split('.')[1])}: no rows")
    return rows


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


def _check_env_resets(
    config: TrainConfig, tokenizer, tasks: dict[str, list[dict]], found: _Findings
) -> list[str]:
    """The env built, and reset on the first row of each split that was read, its first prompt
    tokenised; each split's failure recorded in ``found``."""
    from agent_r1.envs.registry import get_env_factory
    from agent_r1.train.builders import env_factory

    if not config.env.name:
        return []
    ok, build = found.run(env_factory, config, tokenizer)
    if not ok:
        return []
    if getattr(get_env_factory(config.env.name), "reset_calls_policy", False):

        def built() -> str:
            env = build()  # construction errors name env.kwargs; reset needs the model
            _check_roles(config, env.episode_roles() or (), f"env {config.env.name!r}")
            return f"env {config.env.name!r}: built (its reset runs the model: not reset here)"

        ok, line = found.run(built)
        return [line] if ok else []
    report = []
    for split, rows in tasks.items():
        source = getattr(config.data, split.split(".")[1])
        where = f"{split}: {source}: row 0"
        ok, n_prompt = found.run(_reset_first, build, rows[0], tokenizer, where, config)
        if ok:
            report.append(
                f"env {config.env.name!r}: built and reset on {split} row 0 ({n_prompt} prompt tokens)"
            )
    return report


def _reset_first(
    build: Callable[[], Any], row: dict[str, Any], tokenizer, where: str, config: TrainConfig
) -> int:
    """A new env from ``build`` reset on ``row``: its first prompt's token count (``_reset_once``)."""
    return asyncio.run(_reset_once(build(), row, tokenizer, where, config))


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


_CHECK_ERRORS = (ConfigError, DataError, ModelNotFoundError, NoChatTemplateError)
PREFLIGHT_ERRORS = (*_CHECK_ERRORS, PreflightErrors)
"""What ``preflight`` raises: each a message for people that names the key (several: one per line),
printed once, exit 2."""
