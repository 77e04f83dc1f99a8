"""Builders: plain functions that make the trainer's parts from a config.

Every entry point builds its parts with these — the single-process trainer, the Ray rollout actors
and learner workers (each builds what it runs, from the config it was sent), ``agent-r1 eval`` — so a
part exists in one version only.
"""

from __future__ import annotations

import difflib
import importlib.util
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from agent_r1.algos import ADVANTAGE_ESTIMATORS, Needs, PolicyObjective, ValueObjective
from agent_r1.flows.base import AgentEnvLoop, AgentFlow
from agent_r1.train.config import ConfigError, ConfigErrors, TrainConfig
from agent_r1.train.learner import Learner, load_policy
from agent_r1.types import SamplingParams

__all__ = [
    "agent_loop",
    "base_path",
    "build_learners",
    "check_attention",
    "check_engine_kwargs",
    "check_env",
    "compute_dtype",
    "critic_learner",
    "critic_model_config",
    "env_factory",
    "estimator_needs",
    "eval_sampling_params",
    "load_config_tokenizer",
    "load_own_models",
    "load_reference",
    "policy_learner",
    "policy_objective",
    "own_engines",
    "resolve_device",
    "precision_line",
    "rollout_engine",
    "sampler_dtype",
    "rollout_flows",
    "sampling_params",
    "value_objective",
]

logger = logging.getLogger(__name__)


def estimator_needs(config: TrainConfig) -> Needs:
    """What the configured advantage estimator declared it needs (a critic, and at which level)."""
    return ADVANTAGE_ESTIMATORS.needs(config.algorithm.advantage.name)


def resolve_device(config: TrainConfig) -> torch.device:
    """``model.device`` as a torch device ('auto': the first CUDA device when torch sees one)."""
    wanted = config.model.device
    if wanted == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if wanted == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ConfigError(
            "model.device",
            f"{wanted!r} asked for, but torch {torch.__version__} ({build}) sees no CUDA device; "
            "available: 'cpu' (or 'auto', which picks the CPU here)",
        )
    index = int(wanted.split(":")[1]) if ":" in wanted else 0
    if index >= torch.cuda.device_count():
        raise ConfigError(
            "model.device",
            f"{wanted!r} asked for, but there are {torch.cuda.device_count()} CUDA devices "
            f"(cuda:0 .. cuda:{torch.cuda.device_count() - 1})",
        )
    return torch.device("cuda", index)


def compute_dtype(config: TrainConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """``model.compute_dtype`` for a learner on ``device`` ('auto' resolved), and why
    (``agent_r1.models.precision.resolve_compute_dtype``)."""
    from agent_r1.models.precision import resolve_compute_dtype

    return resolve_compute_dtype(config.model.compute_dtype, torch.device(device))


def sampler_dtype(config: TrainConfig, device: torch.device) -> tuple[torch.dtype, str]:
    """``rollout.compute_dtype`` for an engine on ``device`` ('auto' resolved), and why
    (``agent_r1.models.precision.resolve_compute_dtype``: the learner's rule)."""
    from agent_r1.models.precision import resolve_compute_dtype

    return resolve_compute_dtype(config.rollout.compute_dtype, torch.device(device))


def precision_line(config: TrainConfig) -> str | None:
    """What the learner and the sampler compute in and why, for a run's first lines; None when both
    keys are float32 as configured (the default: nothing to say)."""
    if {config.model.compute_dtype, config.rollout.compute_dtype} == {"float32"}:
        return None
    device = resolve_device(config)
    _, learner = compute_dtype(config, device)
    _, sampler = sampler_dtype(config, device)
    return f"the learner computes in {learner}; the sampler in {sampler}"


def check_attention(config: TrainConfig) -> None:
    """Refuse an attention kernel whose package is missing, naming the key (unknown names are refused
    by the config itself)."""
    if (
        config.model.attn_implementation == "flash_attention_2"
        and importlib.util.find_spec("flash_attn") is None
    ):
        raise ConfigError(
            "model.attn_implementation",
            "'flash_attention_2' needs the flash-attn package (pip install flash-attn, on a CUDA "
            "machine); available without it: 'sdpa', 'eager'",
        )


def load_config_tokenizer(config: TrainConfig):
    """The tokenizer of ``model.tokenizer`` (or ``model.path``), with its chat template checked."""
    from agent_r1.models.loading import load_tokenizer

    if not (config.model.tokenizer or config.model.path):
        raise ConfigError("model.path", "no model given: set model.path")
    return load_tokenizer(
        config.model.tokenizer or config.model.path,
        key="model.tokenizer" if config.model.tokenizer else "model.path",
    )


def sampling_params(config: TrainConfig) -> SamplingParams:
    rollout = config.rollout
    return SamplingParams(
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_tokens=rollout.max_tokens,
    )


def eval_sampling_params(config: TrainConfig) -> SamplingParams:
    return replace(sampling_params(config), temperature=config.rollout.eval_temperature)


def env_factory(config: TrainConfig, tokenizer) -> Callable[[], Any]:
    """``env.name``'s factory called with ``env.kwargs`` (and ``tokenizer=`` when it takes one). An
    exception while building the env becomes a ``ConfigError`` naming ``env.kwargs``, which feeds
    the construction (the run's halt message, ``agent_r1.train.health``, then points at the config)."""
    from agent_r1.envs.base import AgentEnv
    from agent_r1.envs.registry import get_env_factory

    name, kwargs = config.env.name, dict(config.env.kwargs)
    if not name:
        raise ConfigError("env.name", "no environment: set env.name (or pass env_factory= / flow=)")
    try:
        factory = get_env_factory(name)
    except (ValueError, TypeError) as e:
        raise ConfigError("env.name", str(e)) from None
    try:
        takes_tokenizer = "tokenizer" in inspect.signature(factory).parameters
    except (TypeError, ValueError):
        takes_tokenizer = False
    if takes_tokenizer and "tokenizer" not in kwargs:
        kwargs["tokenizer"] = tokenizer
    configured = sorted(config.env.kwargs)  # names only: values may hold credentials

    def build() -> AgentEnv:
        try:
            env = factory(**kwargs)
        except Exception as error:
            raise ConfigError(
                "env.kwargs",
                f"building env {name!r} with env.kwargs {configured} raised {type(error).__name__}: {error}",
            ) from error
        if not isinstance(env, AgentEnv):
            raise ConfigError(
                "env.name", f"{name!r} built a {type(env).__name__}, which is not an agent_r1 AgentEnv"
            )
        return env

    return build


def check_env(config: TrainConfig) -> None:
    """``env.name``'s factory found and, when it is an ``AgentEnv`` class, its ``check_kwargs`` hook run
    on ``env.kwargs`` (an ``agent_program``'s agent and reward imported): a ``ConfigError`` naming the
    key, before any model loads. No-op without ``env.name``."""
    from agent_r1.envs.base import AgentEnv, EnvKwargsError
    from agent_r1.envs.registry import get_env_factory

    if not config.env.name:
        return
    try:
        factory = get_env_factory(config.env.name)
    except (ValueError, TypeError) as e:
        raise ConfigError("env.name", str(e)) from None
    if not (isinstance(factory, type) and issubclass(factory, AgentEnv)):
        return
    try:
        factory.check_kwargs(dict(config.env.kwargs))
    except EnvKwargsError as e:
        raise ConfigError(f"env.kwargs.{e.key}", e.why) from None
    except (ValueError, TypeError) as e:
        raise ConfigError("env.kwargs", str(e)) from None


def agent_loop(config: TrainConfig, tokenizer, make_env: Callable[[], Any], sampling: SamplingParams):
    """The configured ``AgentEnvLoop`` flow over ``make_env`` with ``sampling``."""
    return AgentEnvLoop(
        make_env,
        tokenizer,
        sampling,
        max_steps=config.rollout.max_steps,
        max_prompt_tokens=config.rollout.max_prompt_tokens,
    )


def policy_objective(config: TrainConfig) -> PolicyObjective:
    """The configured per-token policy objective: the ``algorithm`` sections passed on unchanged; with
    one update per batch its forwards are at the sampled weights and measure the sampler/learner
    mismatch (``PolicyObjective.measure_mismatch``), unless the old log-probs phase already does
    (``agent_r1.train.phases.recomputes_old_logprobs``)."""
    from agent_r1.train.phases import recomputes_old_logprobs

    algo, trainer = config.algorithm, config.trainer
    single = trainer.ppo_epochs * trainer.mini_batches == 1
    return PolicyObjective(
        loss=algo.policy_loss,
        kl=algo.kl,
        entropy_coef=algo.entropy_coef,
        measure_mismatch=single and not recomputes_old_logprobs(config, trainer.mini_batches),
    )


def value_objective(config: TrainConfig) -> ValueObjective:
    return ValueObjective(coef=config.algorithm.value_coef, clip=config.algorithm.value_clip)


def base_path(config: TrainConfig) -> str:
    """``model.path``, required where a second copy of the model is loaded."""
    if not config.model.path:
        raise ConfigError(
            "model.path",
            "needed to load a second copy of the model (a reference model, a critic, or the "
            "engine's copy with rollout.share_model: false and LoRA)",
        )
    return config.model.path


def load_reference(config: TrainConfig, model, device: torch.device | None = None):
    """The frozen reference policy for the KL term, or None: no KL (``algorithm.kl.coef: 0``), or LoRA
    from a fresh adapter (the reference is the policy with its adapter disabled, no second model).
    A run that starts from a saved adapter (``model.adapter``) is held to where it started: the base
    with that adapter merged, a second copy."""
    if config.algorithm.kl.coef <= 0 or (hasattr(model, "peft_config") and config.model.adapter is None):
        return None
    from agent_r1.models.loading import load_frozen_model

    reference = load_frozen_model(
        base_path(config),
        dtype=config.model.dtype,
        attn_implementation=config.model.attn_implementation,
        adapter=config.model.adapter,
    )
    return reference.to(device) if device is not None else reference


def _total_updates(config: TrainConfig) -> int:
    trainer = config.trainer
    return trainer.steps * trainer.ppo_epochs * trainer.mini_batches


def policy_learner(
    config: TrainConfig, model, *, reference=None, sync=None, own_models=None, dtype=None
) -> Learner:
    """The policy's ``Learner`` (AdamW, schedule) over ``model`` (built by ``load_policy``), computing
    in ``dtype`` (``compute_dtype``; None: the parameters' dtype); with
    several policies (``config.policies``) a ``PolicyLearners``: one Learner per trained policy over
    its adapter, with the policy's learning rate and gradient sync (``sync``: one, or a mapping by
    policy from ``policy_syncs``); a policy with a model of its own
    (``own_models``: ``load_own_models``') over its adapter on that model."""
    if config.policies:
        from agent_r1.train.policies import PolicyLearners, adapter_parameters, trained_policies

        own_models = own_models or {}
        learners = {}
        for name in trained_policies(config):
            policy_model = own_models.get(name, model)
            learners[name] = Learner(
                policy_model,
                replace(config.trainer, lr=config.policies[name].lr or config.trainer.lr),
                temperature=config.rollout.temperature,
                total_optimizer_steps=_total_updates(config),
                sync=sync.get(name) if isinstance(sync, Mapping) else sync,  # a learner group's: per policy
                parameters=adapter_parameters(policy_model, name),
                compute_dtype=dtype,
            )
        return PolicyLearners(learners, model)
    return Learner(
        model,
        config.trainer,
        temperature=config.rollout.temperature,
        total_optimizer_steps=_total_updates(config),
        reference=reference,
        sync=sync,
        compute_dtype=dtype,
    )


def critic_learner(config: TrainConfig, model, *, sync=None, dtype=None) -> Learner:
    """The critic's ``Learner`` (``trainer.critic_lr``) over a value model from ``load_critic``,
    computing in ``dtype`` (as ``policy_learner``)."""
    from agent_r1.train.critic import micro_batch_values

    return Learner(
        model,
        replace(config.trainer, lr=config.trainer.critic_lr),
        temperature=config.rollout.temperature,
        total_optimizer_steps=_total_updates(config),
        forward=micro_batch_values,
        sync=sync,
        compute_dtype=dtype,
    )


def critic_model_config(config: TrainConfig):
    """The ``ModelConfig`` a critic loads its body from (the policy's base model)."""
    return replace(config.model, path=base_path(config))


def rollout_flows(
    config: TrainConfig,
    tokenizer,
    *,
    flow: AgentFlow | None = None,
    eval_flow: AgentFlow | None = None,
    make_env: Callable[[], Any] | None = None,
    with_eval: bool = True,
) -> tuple[AgentFlow, AgentFlow | None]:
    """The training flow and the evaluation flow (None without ``with_eval``): ``flow`` / ``eval_flow``
    when given, else ``agent_loop``s over ``make_env`` (default: ``env_factory``) with the rollout and
    the evaluation sampling settings."""
    if flow is None or (eval_flow is None and with_eval):
        make_env = make_env or env_factory(config, tokenizer)
    flow = flow or agent_loop(config, tokenizer, make_env, sampling_params(config))
    if eval_flow is None and with_eval and make_env is not None:
        eval_flow = agent_loop(config, tokenizer, make_env, eval_sampling_params(config))
    return flow, eval_flow


def _deterministic_engine(config: TrainConfig, source, device) -> dict:
    """The HF engine's settings under ``trainer.deterministic``, so that each response is computed from
    its own tokens alone, whichever requests happen to be live at once (docs/training.md, Determinism):
    batch-invariant decoding of one policy on the CPU at one torch thread
    (``agent_r1.rollout.batch_invariant``: every finished turn kept for the next until the weights
    change), else (a GPU, more threads, several policies) one request at a time and never a stored
    prefix."""
    from agent_r1.rollout import batch_invariant

    placed = (
        next(source.parameters()).device if hasattr(source, "parameters") else torch.device(device or "cpu")
    )
    if batch_invariant.possible(placed) and not config.policies:
        return {"batch_invariant": True}
    return {"max_batch_size": 1, "prefix_cache_entries": 0}


_FILLED_IN = {
    "model": "model.path",
    "adapter": "model.adapter",
    "tokenizer": "model.tokenizer",
    "dtype": "model.dtype (vLLM: rollout.compute_dtype when narrower)",
    "compute_dtype": "rollout.compute_dtype",
    "device": "model.device",
    "max_batch_size": "rollout.max_batch_size (vLLM's own limit is max_num_seqs)",
    "roles": "policies and roles",
}
"""The engine arguments that ``rollout_engine`` (through ``build_engine``) fills in itself, and the
config keys they come from."""


def check_engine_kwargs(config: TrainConfig) -> str:
    """``rollout.engine_kwargs`` against the keyword arguments that ``rollout.engine`` takes
    (``agent_r1.rollout.factory.engine_arguments``): each one the engine does not take, or that
    agent-r1 fills in from another key, is a ``ConfigError`` naming ``rollout.engine_kwargs.<key>``
    (all of them at once), so that none surfaces as a TypeError once the engine is being built.
    Returns the line ``agent-r1 check`` prints; vLLM's arguments are known only where vLLM is
    installed, and the line says when they were not checked."""
    from agent_r1.rollout.factory import engine_arguments

    kind, given = config.rollout.engine, sorted(config.rollout.engine_kwargs)
    if not given:
        return f"rollout.engine_kwargs: none for rollout.engine {kind!r}"
    takes = engine_arguments(kind)
    if takes is None:
        return f"rollout.engine_kwargs {given}: not checked, vLLM not installed here"
    takes = takes - _FILLED_IN.keys()
    errors = []
    for key in given:
        if key in _FILLED_IN:
            why = f"agent-r1 sets it from {_FILLED_IN[key]}: remove it here"
        elif key not in takes:
            close = difflib.get_close_matches(key, takes, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            accepted = sorted(takes) if kind == "hf" else f"the {len(takes)} of vllm.LLM and vllm.EngineArgs"
            why = (
                f"not an argument of rollout.engine {kind!r}{hint}, which takes {accepted} "
                "(rollout.engine_kwargs go to that engine alone: remove another engine's settings)"
            )
        else:
            continue
        errors.append(ConfigError(f"rollout.engine_kwargs.{key}", why))
    ConfigErrors.raise_all(errors)
    return f"rollout.engine_kwargs {given}: arguments of rollout.engine {kind!r}"


def rollout_engine(config: TrainConfig, tokenizer, source=None, *, device=None, roles=None):
    """The configured engine (``rollout.engine`` with ``rollout.engine_kwargs``) over ``source``: a
    loaded model (the HF engine), or by default the policy's weights (``model.path``, with
    ``model.adapter`` merged in when there is one policy), loaded frozen (on
    ``device`` for the HF engine; None: the CPU). With several policies it serves ``roles`` (role ->
    adapter; default ``engine_roles``: the roles of the shared base's policies). An engine that
    cannot be built here is a ``ConfigError`` naming ``rollout.engine``, and an engine argument it
    does not take one naming it (``check_engine_kwargs``)."""
    from agent_r1.rollout.factory import EngineUnavailable, build_engine

    check_engine_kwargs(config)
    rollout = config.rollout
    kwargs = {"max_batch_size": rollout.max_batch_size, **rollout.engine_kwargs}
    if config.trainer.deterministic and rollout.engine == "hf":
        kwargs.update(_deterministic_engine(config, source, device))
    if config.policies:
        from agent_r1.train.policies import engine_roles, max_adapter_rank

        kwargs["roles"] = engine_roles(config) if roles is None else roles  # each role's adapter, one batch
        if rollout.engine == "vllm":
            kwargs.setdefault("max_lora_rank", max_adapter_rank(config))
    if source is None and not config.policies:
        kwargs["adapter"] = config.model.adapter  # merged: the policy's weights (several: its adapters)
    weights_dtype = config.model.dtype
    sampler, _ = sampler_dtype(config, torch.device(device or "cpu"))
    if rollout.engine == "hf":
        kwargs["compute_dtype"] = sampler
    elif sampler != torch.float32:  # vLLM computes in its weights' type
        weights_dtype = str(sampler).removeprefix("torch.")
    try:
        engine = build_engine(
            rollout.engine,
            base_path(config) if source is None else source,
            tokenizer=tokenizer,
            dtype=weights_dtype,
            device=device,
            **kwargs,
        )
    except EngineUnavailable as error:
        raise ConfigError("rollout.engine", str(error)) from None
    if config.policies and rollout.engine == "vllm" and roles is None:
        from agent_r1.train.policies import adapter_folders

        frozen = adapter_folders(config)
        if frozen:  # loaded once from their folders: the learner sends trained adapters only
            engine.update_adapters(frozen)
    return engine


def policy_syncs(config: TrainConfig, model, data_parallel: Callable[[Any, Callable[[], Any]], Any]):
    """The data-parallel strategy of the policy on a rank of a learner group; with several policies
    one per trained adapter, each made while its adapter alone is active (and so alone trainable), so
    that each one's gradient sync covers exactly that adapter's parameters (DDP registers the
    parameters that require a gradient when it wraps the model)."""

    def replica():
        return load_policy(config.model)

    if not config.policies:
        return data_parallel(model, replica)
    from agent_r1.train.policies import active_adapter, adapter_policies

    syncs = {}
    for name in adapter_policies(config):
        with active_adapter(model, name):
            syncs[name] = data_parallel(model, replica)
    return syncs


def build_learners(
    config: TrainConfig,
    model,
    device,
    *,
    data_parallel: Callable[[Any, Callable[[], Any]], Any] | None = None,
    own_models=None,
) -> tuple[Learner, Learner | None]:
    """The policy's ``Learner`` over ``model`` (with the frozen reference for the KL term; with
    several policies, ``own_models`` their models of their own) and, for estimators that read
    values, the critic's (a value head on its own copy of the policy's body), all computing in
    ``model.compute_dtype`` on ``device``.

    ``data_parallel(model, replica)``: on a rank of a learner group, the ``GradientSync`` strategy
    that wraps a model (``replica()`` builds an unsharded copy of it); None in one process, where the
    critic is moved to ``device`` (the policy is already there)."""
    dtype, why = compute_dtype(config, device)
    logger.info("the learner computes in %s", why)
    sync = None if data_parallel is None else policy_syncs(config, model, data_parallel)
    reference = load_reference(config, model, device)
    policy = policy_learner(config, model, reference=reference, sync=sync, own_models=own_models, dtype=dtype)
    if estimator_needs(config).critic is None:
        return policy, None
    from agent_r1.train.critic import load_critic

    critic_config = critic_model_config(config)
    critic_model = load_critic(critic_config)
    if data_parallel is None:
        return policy, critic_learner(config, critic_model.to(device), dtype=dtype)
    critic_sync = data_parallel(critic_model, lambda: load_critic(critic_config))
    return policy, critic_learner(config, critic_model, sync=critic_sync, dtype=dtype)


def load_own_models(config: TrainConfig, device=None, tokenizer=None) -> dict[str, Any]:
    """Each policy with a model of its own, loaded (on ``device``): a trained one with a LoRA adapter
    of its name (``load_policy``, ``model.lora``'s settings), a frozen one as it is. Its tokenizer is
    checked first (``check_own_models``) against ``tokenizer`` (default: the run's, loaded)."""
    from agent_r1.models.loading import load_frozen_model
    from agent_r1.train.policies import check_own_models, own_model_policies

    names = own_model_policies(config)
    if not names:
        return {}
    check_own_models(config, tokenizer if tokenizer is not None else load_config_tokenizer(config))
    models = {}
    for name in names:
        policy = config.policies[name]
        if policy.frozen:
            model = load_frozen_model(policy.path, dtype=config.model.dtype, key=f"policies.{name}.path")
        else:
            model = load_policy(config.model, path=policy.path, adapters=[name])
        models[name] = model if device is None else model.to(device)
    return models


def own_engines(config: TrainConfig, tokenizer, models: Mapping[str, Any]) -> dict[str, Any]:
    """Each role of a policy with a model of its own -> an engine over that model (``models``:
    ``load_own_models``'), one per policy, built as the run's engine is (``rollout_engine``) and
    sharing the model (its optimizer's steps are what it samples next)."""
    from agent_r1.train.policies import roles_of

    engines = {}
    for name, model in models.items():
        adapter = None if config.policies[name].frozen else name
        roles = {role: adapter for role in roles_of(config, [name])}
        engines[name] = rollout_engine(config, tokenizer, model, roles=roles)
    return {role: engines[policy] for role, policy in roles_of(config, list(engines)).items()}
