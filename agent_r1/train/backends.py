"""The two small protocols the RL loop talks to, and their in-process implementations.

``agent_r1.train.trainer.Trainer`` is the loop, once; what it runs on is two backends:

- a **rollout backend** rolls out groups for given tasks with a given seed (``submit`` then
  ``collect``, so that a rollout may run while the learner trains), takes new weights with a policy
  version (``update_weights``), and may free its memory while the learner trains (``sleep`` /
  ``wake``);
- a **learner backend** computes log-probs (of the policy or the reference) and values, takes
  optimizer steps with a given per-token objective, hands out its weights for the rollout backend,
  and saves / loads its state in a checkpoint.

In one process (``LocalRollout``, ``LocalLearner``, built by ``local_backends``) they wrap an engine
and ``Learner`` objects; on Ray (``agent_r1.distributed``) the same protocols are implemented by
``RolloutPool`` (engine actors) and ``LearnerGroup`` (torch.distributed workers).

``make_backends(config, tokenizer, parts)`` is the one place that assembles them: ``BACKENDS`` maps each
``distributed.backend`` to its builder by entry-point string, imported on first use, so this package
never imports ``agent_r1.distributed`` (which imports Ray). Both build their parts with the same
builders (``agent_r1.train.builders``); every Ray learner worker holds the learners ``local_learner``
builds (a ``LocalLearner`` whose ``Learner``s synchronise through a data-parallel strategy), so a
checkpoint is written and read by one piece of code in one format (``agent_r1.train.checkpoint``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import importlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

from torch import Tensor

from agent_r1.flows.base import AgentFlow, seeded_rollout_groups
from agent_r1.rollout.versioned import VersionedEngine
from agent_r1.train.batching import MicroBatch
from agent_r1.train.checkpoint import save_checkpoint, split_critic, with_critic
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.learner import Learner, MiniBatch, TokenLoss
from agent_r1.train.policies import PolicyLearners
from agent_r1.types import Task, TrajectoryGroup

__all__ = [
    "BACKENDS",
    "BackendKind",
    "BackendParts",
    "Backends",
    "EngineClock",
    "LearnerBackend",
    "LocalLearner",
    "LocalRollout",
    "RolloutBackend",
    "absolute_paths",
    "backend_config",
    "engine_copy",
    "export_weights",
    "local_backends",
    "local_learner",
    "local_rollout",
    "make_backends",
]

logger = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """Where trajectories are sampled."""

    def submit(self, tasks: Sequence[Task], n: int, seed_base: str, *, evaluation: bool = False) -> Any:
        """Start ``n`` samples of every task, seeded by ``seed_base`` (evaluation: the eval flow)."""

    def collect(self, job: Any) -> list[TrajectoryGroup]:
        """The groups of a submitted job, in task order; each step stamped with its policy version."""

    def update_weights(self, weights: Any, version: int) -> None:
        """Sample from now on with ``weights`` (what ``LearnerBackend.weights`` returned) as ``version``."""

    def sleep(self) -> None:
        """Free memory while the learner trains (a no-op where there is nothing to free)."""

    def wake(self) -> None: ...

    def metrics(self) -> dict[str, float]:
        """Backend-specific counters for the step's metrics since the previous call (e.g. actor
        restarts, the engine's busy and idle seconds)."""

    def close(self) -> None: ...


class LearnerBackend(Protocol):
    """Where the policy (and the critic, when the estimator needs one) is trained."""

    has_critic: bool

    def logprobs(
        self, micro_batches: Sequence[MicroBatch], num_tokens: int, *, reference: bool = False
    ) -> Tensor:
        """Log-probs (num_tokens,) of the policy (or the reference) in the flat token order."""

    def update(self, mini_batch: MiniBatch, objective: TokenLoss, *, with_entropy: bool = False) -> dict:
        """One optimizer step of the policy on ``objective`` (a picklable per-token loss)."""

    def values(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> Tensor:
        """The critic's values (num_tokens,)."""

    def teacher_logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> Tensor:
        """The local distillation teacher's log-probs (num_tokens,) (``agent_r1.train.teacher``)."""

    def update_critic(self, mini_batch: MiniBatch, objective: TokenLoss) -> dict: ...

    def weights(self) -> Any:
        """The policy's weights as the matching rollout backend takes them."""

    def save_checkpoint(self, directory: Path, step: int, trainer_state: dict) -> Path: ...

    def load_checkpoint(self, path: Path) -> dict:
        """Restore the learner state of checkpoint ``path``; returns the trainer state it holds."""

    def metrics(self) -> dict[str, float]:
        """Backend-specific counters for the step's metrics (e.g. learner group rebuilds)."""

    def close(self) -> None: ...


@dataclass(eq=False)
class _LocalJob:
    tasks: list[Task]
    n: int
    seed_base: str
    evaluation: bool
    started: float | None = None  # wall-clock times (time.time()) of the rollout's first and last work
    finished: float | None = None
    running: concurrent.futures.Future | None = None  # background: the rollout on the rollout thread
    groups: list[TrajectoryGroup] | None = None


class _RolloutThread:
    """An event loop on its own thread: background rollouts run there while the learner trains (the
    engines' own scheduler threads do the forward passes; this loop runs the flows and envs)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="agent-r1-rollout", daemon=True)
        self.thread.start()

    def run(self, coroutine) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def close(self) -> None:
        """Cancel what still runs (a rollout abandoned by an error: its envs are closed as it
        unwinds), then stop the loop."""
        asyncio.run_coroutine_threadsafe(_cancel_all(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _cancel_all() -> None:
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


class EngineClock:
    """An engine's seconds since the previous ``read`` (the first: since the clock was built): prefilling,
    decoding, and the rest of that wall-clock window, idle (waiting for requests, e.g. while
    trajectories wait on tools or the learner trains, or for a weight update). Only for engines
    that count their busy time (``HFEngine.prefill_seconds`` / ``decode_seconds``); others get
    nothing, not zeros."""

    def __init__(self, engine, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.clock = engine, clock
        self.counts = hasattr(engine, "prefill_seconds") and hasattr(engine, "decode_seconds")
        self.last = self._now()

    def _now(self) -> tuple[float, float, float]:
        if not self.counts:
            return (0.0, 0.0, 0.0)
        return self.clock(), self.engine.prefill_seconds, self.engine.decode_seconds

    def read(self) -> dict[str, float]:
        if not self.counts:
            return {}
        now = self._now()
        window, prefill, decode = (b - a for a, b in zip(self.last, now, strict=True))
        self.last = now
        return {
            "time/engine_prefill": prefill,
            "time/engine_decode": decode,
            "time/engine_idle": max(window - prefill - decode, 0.0),
            "throughput/engine_busy_fraction": min((prefill + decode) / max(window, 1e-9), 1.0),
        }


class LocalRollout:
    """An engine in this process and the train / eval flows.

    ``shares_model``: the engine samples from the learner's own model object (the HF engine's default,
    ``rollout.share_model``), so a weight update is a version bump. Otherwise ``update_weights`` copies
    the exported weights in (an engine copy, vLLM). ``sleeps``: ``sleep`` / ``wake`` release and restore
    the engine's accelerator memory around each update (vLLM's sleep mode on one GPU).

    ``background``: a submitted job starts at once on a rollout thread and runs while this thread
    trains (``trainer.mode: async``); weight updates then wait only for the requests in flight
    (``agent_r1.rollout.versioned``). Otherwise a job runs when it is collected.

    Every step is stamped with the policy version that sampled it."""

    def __init__(
        self,
        engine,
        flow: AgentFlow,
        eval_flow: AgentFlow | None,
        *,
        shares_model: bool,
        owns_engine: bool = True,
        sleeps: bool = False,
        background: bool = False,
    ) -> None:
        if background and shares_model:
            raise ValueError(
                "LocalRollout: a background rollout samples while the learner updates, so the engine "
                "needs its own copy of the weights, not the learner's model (rollout.share_model: false)"
            )
        self.raw_engine = engine
        self.engine = VersionedEngine(engine)
        self.flow, self.eval_flow = flow, eval_flow
        self.shares_model, self.owns_engine, self.sleeps = shares_model, owns_engine, sleeps
        self._thread = _RolloutThread() if background else None
        self._clock = EngineClock(engine)

    def submit(self, tasks: Sequence[Task], n: int, seed_base: str, *, evaluation: bool = False) -> _LocalJob:
        if evaluation and self.eval_flow is None:
            raise ValueError("no evaluation flow: give an env (env.name or env_factory) or eval_flow")
        job = _LocalJob(list(tasks), n, seed_base, evaluation)
        if self._thread is not None:
            job.started = time.time()  # handed to the rollout thread, which starts it at once
            job.running = self._thread.run(self._run(job))
        return job

    def collect(self, job: _LocalJob) -> list[TrajectoryGroup]:
        if job.groups is None:
            job.groups = (
                job.running.result() if job.running is not None else asyncio.run(self._run_alone(job))
            )
        return job.groups

    async def _run_alone(self, job: _LocalJob) -> list[TrajectoryGroup]:
        """``job`` on an event loop that ends with it, and the engine's HTTP sessions on it."""
        try:
            return await self._run(job)
        finally:
            await self._close_sessions()

    async def _close_sessions(self) -> None:
        """The engine's HTTP sessions on this event loop (``aclose``: a server policy's
        ``OpenAIEngine``, through ``RoleRouter``), closed before the loop ends."""
        aclose = getattr(self.raw_engine, "aclose", None)
        if aclose is not None:
            await aclose()

    async def _run(self, job: _LocalJob) -> list[TrajectoryGroup]:
        job.started = job.started or time.time()
        flow = self.eval_flow if job.evaluation else self.flow
        watch = self.engine.watch()
        groups = await seeded_rollout_groups(flow, self.engine, job.tasks, job.n, job.seed_base)
        job.finished = time.time()
        return [watch.stamp(g) for g in groups]

    def update_weights(self, weights: Callable[[], Any], version: int) -> None:
        """``weights``: a function returning ``(name, tensor)`` pairs (called only when the engine holds
        its own copy). With a job in flight the swap waits for its requests being sampled and holds
        its next ones; this thread blocks until the new weights are in."""

        def apply() -> None:
            if self.shares_model:
                self.raw_engine.weight_version = version
            else:
                self.raw_engine.update_weights(weights(), version=version)

        swap = self.engine.swap(apply, version)
        if self._thread is not None:
            self._thread.run(swap).result()
        else:
            asyncio.run(swap)

    def sleep(self) -> None:
        if self.sleeps:
            self.raw_engine.sleep()

    def wake(self) -> None:
        if self.sleeps:
            self.raw_engine.wake()

    def metrics(self) -> dict[str, float]:
        """The engine's busy and idle seconds since the previous call (``EngineClock``) and, in the
        background, the requests a weight swap held."""
        metrics = self._clock.read()
        if self._thread:
            metrics["rollout/held_requests"] = float(self.engine.held_requests)
        return metrics

    def close(self) -> None:
        try:
            close = getattr(self.raw_engine, "close", None)
            if self.owns_engine and close is not None:
                close()
        finally:
            if self._thread is not None:
                self._thread.run(self._close_sessions()).result()
                self._thread.close()
                self._thread = None


class LocalLearner:
    """The learners of one process: the policy's ``Learner``, the critic's and the local distillation
    teacher. It is the in-process learner backend, and each Ray learner worker holds one (its
    ``Learner``s then synchronise through a data-parallel strategy). Checkpoints via
    ``agent_r1.train.checkpoint`` (the critic's state rides in the trainer state)."""

    def __init__(
        self, policy: Learner, critic: Learner | None, *, tokenizer, keep_checkpoints: int, teacher=None
    ) -> None:
        self.policy, self.critic, self.teacher = policy, critic, teacher
        self.tokenizer, self.keep_checkpoints = tokenizer, keep_checkpoints
        self.has_critic = critic is not None

    @property
    def model(self):
        return self.policy.model

    def for_policy(self, name: str | None) -> LocalLearner:
        """The learners that train policy ``name`` (``agent_r1.train.policies``): itself with one
        policy (None); else that policy's learner, its adapter active, with the same teacher."""
        if name is None:
            return self
        return LocalLearner(
            self.policy.of(name),
            None,
            tokenizer=self.tokenizer,
            keep_checkpoints=self.keep_checkpoints,
            teacher=self.teacher,
        )

    def logprobs(self, micro_batches, num_tokens: int, *, reference: bool = False) -> Tensor:
        return self.policy.logprobs(micro_batches, num_tokens, reference=reference)

    def update(self, mini_batch: MiniBatch, objective: TokenLoss, *, with_entropy: bool = False) -> dict:
        return self.policy.update(mini_batch, objective, with_entropy=with_entropy)

    def values(self, micro_batches, num_tokens: int) -> Tensor:
        return self.critic.logprobs(micro_batches, num_tokens)

    def update_critic(self, mini_batch: MiniBatch, objective: TokenLoss) -> dict:
        return self.critic.update(mini_batch, objective)

    def teacher_logprobs(self, micro_batches, num_tokens: int) -> Tensor:
        return self.teacher.logprobs(micro_batches, num_tokens)

    def weights(self) -> Callable[[], Any]:
        """What an engine's own copy takes after an update: the merged weights (``export_weights``);
        with several policies ``{adapter: LoraWeights}`` of the adapters that changed since the
        previous sync (``PolicyLearners.weights``), which the HF and vLLM engines both load."""
        if isinstance(self.policy, PolicyLearners):
            return self.policy.weights()
        model = self.policy.model
        return lambda: export_weights(model)

    def save_checkpoint(self, directory: Path, step: int, trainer_state: dict) -> Path | None:
        """Checkpoint ``step``: the policy in ``model/`` and ``learner.pt``, the critic in the trainer
        state (``with_critic``). Collective on a learner group: every rank calls it (sharded state is
        gathered), rank 0 writes it; the others return None."""
        # several policies (``PolicyLearners``): each policy's optimizer is in its state_dict
        single = isinstance(self.policy, Learner)
        model, optimizer_state = self.policy.sync.full_state(self.policy, optimizer=single)
        if self.critic is not None:
            critic, critic_optimizer = self.critic.sync.full_state(self.critic, optimizer=True)
            if critic is not None:
                critic_learner = {**self.critic.state_dict(), "optimizer": critic_optimizer}
                trainer_state = with_critic(trainer_state, critic.state_dict(), critic_learner)
        if model is None:
            return None
        return save_checkpoint(
            directory,
            step,
            model,
            {**self.policy.state_dict(), "optimizer": optimizer_state},
            trainer_state,
            keep=self.keep_checkpoints,
            tokenizer=self.tokenizer,
            own_models=getattr(self.policy, "own_models", None),
        )

    def load_checkpoint(self, path: Path, *, verify: bool = False) -> dict:
        """Restore checkpoint ``path`` on every rank; returns the trainer state without the critic's.
        ``verify``: check its manifest first (the trainer loads one ``latest_checkpoint`` verified)."""
        trainer_state, critic = split_critic(
            self.policy.sync.load_checkpoint(path, self.policy, verify=verify)
        )
        if self.critic is not None:
            self.critic.sync.load_state(self.critic, *critic)
        return trainer_state

    def metrics(self) -> dict[str, float]:
        return {}

    def close(self) -> None:
        pass


def engine_copy(model, config) -> Any:
    """A frozen copy of the policy for an engine that does not share it. One LoRA policy: the base
    weights from ``model.path`` (with ``model.adapter`` merged, where the policy starts), into which
    each update's merged weights are copied. Several
    policies (``config.policies``): the peft model itself, every adapter included, so that each role
    keeps its adapter; each sync copies in the adapters that changed (``PolicyLearners.weights``)."""
    if hasattr(model, "peft_config") and not config.policies:
        from agent_r1.models.loading import load_frozen_model
        from agent_r1.train.builders import base_path

        return load_frozen_model(
            base_path(config), dtype=config.model.dtype, adapter=config.model.adapter
        ).to(next(model.parameters()).device)
    copied = copy.deepcopy(model)
    for p in copied.parameters():
        p.requires_grad_(False)
    return copied.eval()


def export_weights(model) -> list[tuple[str, Tensor]]:
    """The policy's weights under the base model's Hugging Face names; LoRA deltas merged in
    (computed beside the base weights, which stay untouched)."""
    if not hasattr(model, "peft_config"):
        return [(name, t.detach()) for name, t in model.state_dict().items()]
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    merged: dict[str, Tensor] = {}
    for module_name, module in base.named_modules():
        if isinstance(module, LoraLayer) and not module.merged:
            delta = sum(module.get_delta_weight(a) for a in module.active_adapters if a in module.lora_A)
            merged[f"{module_name}.weight"] = (module.get_base_layer().weight + delta).detach()
    out = []
    for name, tensor in base.state_dict().items():
        if "lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        out.append((clean, merged.get(clean, tensor.detach())))
    return out


def local_rollout(
    config,
    tokenizer,
    *,
    model=None,
    engine=None,
    flow: AgentFlow | None = None,
    eval_flow: AgentFlow | None = None,
    make_env: Callable[[], Any] | None = None,
    with_eval: bool = True,
    device=None,
    background: bool = False,
    own_models=None,
) -> LocalRollout:
    """The in-process rollout backend of ``config``.

    ``model``: the learner's policy (the HF engine shares it with ``rollout.share_model``, or holds a
    copy synced after each update); None for evaluation alone (the engine loads ``model.path``).
    ``engine`` / ``flow`` / ``eval_flow`` / ``make_env``: pre-built parts that replace the configured
    ones. ``with_eval``: build the evaluation flow too. ``background``: rollouts run on a rollout
    thread while the learner trains (``trainer.mode: async``). With several policies, the roles of a
    policy sampled by a server go to it (``RoleRouter`` around the engine, ``server_engines``), those
    of a policy with a model of its own (``own_models``: ``load_own_models``') to an engine over it
    (``own_engines``).
    """
    from agent_r1.train.builders import rollout_engine, rollout_flows

    flow, eval_flow = rollout_flows(
        config, tokenizer, flow=flow, eval_flow=eval_flow, make_env=make_env, with_eval=with_eval
    )
    owns_engine, shares_model = engine is None, False
    rollout = config.rollout
    if engine is None:
        source = None  # evaluation alone, or vLLM: the engine loads model.path
        if rollout.engine == "hf" and model is not None:
            shares_model = rollout.share_model
            source = model if shares_model else engine_copy(model, config)
        engine = rollout_engine(config, tokenizer, source, device=None if model is not None else device)
    engine = routed_engine(config, tokenizer, engine, own_models)
    if background and model is not None and getattr(engine, "model", None) is model:
        raise ConfigError(
            "trainer.mode",
            "async samples while the learner updates, but the engine passed in samples from the "
            "learner's own model object: give it a copy (agent_r1.train.backends.engine_copy)",
        )
    sleeps = bool(rollout.engine_kwargs.get("enable_sleep_mode")) and owns_engine
    if background and sleeps:
        raise ConfigError(
            "rollout.engine_kwargs.enable_sleep_mode",
            "the engine sleeps during each update, but trainer.mode: async samples during it",
        )
    return LocalRollout(
        engine,
        flow,
        eval_flow,
        shares_model=shares_model,
        owns_engine=owns_engine,
        sleeps=sleeps,
        background=background,
    )


def routed_engine(config, tokenizer, engine, own_models=None):
    """``engine``, or with several policies a ``RoleRouter`` that sends the roles of a server's policy
    to the server (``server_engines``) and those of a policy with a model of its own to an engine
    over it (``own_engines``; ``own_models``: ``load_own_models``'), every other role to ``engine``."""
    if not config.policies:
        return engine
    from agent_r1.rollout.router import RoleRouter
    from agent_r1.train.builders import own_engines
    from agent_r1.train.policies import server_engines

    routes = {**server_engines(config, tokenizer), **own_engines(config, tokenizer, own_models or {})}
    return RoleRouter(engine, routes) if routes else engine


def local_learner(config, tokenizer, model, device, *, data_parallel=None, own_models=None) -> LocalLearner:
    """The learners of one process: ``model``'s Learner (with the reference for the KL term; with
    several policies, ``own_models`` their models of their own), for estimators that read values a
    critic, and a local distillation teacher (``algorithm.distill``). The in-process learner backend,
    and (with ``data_parallel``, see ``build_learners``) what each Ray learner worker holds."""
    from agent_r1.train.builders import build_learners
    from agent_r1.train.teacher import load_teacher

    policy, critic = build_learners(config, model, device, data_parallel=data_parallel, own_models=own_models)
    return LocalLearner(
        policy,
        critic,
        tokenizer=tokenizer,
        keep_checkpoints=config.trainer.keep_checkpoints,
        teacher=load_teacher(config, device),
    )


# ---------------------------------------------------------------------------------- assembly


@dataclass(frozen=True)
class Backends:
    """What the RL loop runs on, as ``make_backends`` assembled it."""

    rollouts: RolloutBackend
    learner: LearnerBackend
    model_config: Any  # the policy's transformers config (the prefix-tree cost model reads it)
    learner_device: Any  # where the learner computes (a torch device, or "cpu" / "cuda" on Ray)
    model: Any = None  # the policy, when it lives in this process


@dataclass(frozen=True)
class BackendParts:
    """What ``make_backends`` was handed besides the config: objects the caller built (None: built
    from the config), whether to build the evaluation flow, and the Ray actors' runtime env."""

    model: Any = None
    engine: Any = None
    flow: AgentFlow | None = None
    eval_flow: AgentFlow | None = None
    env_factory: Callable[[], Any] | None = None
    with_eval: bool = True
    runtime_env: dict | None = None

    def objects(self) -> list[str]:
        """The names of the objects passed in."""
        given = {"model": self.model, "engine": self.engine, "flow": self.flow, "eval_flow": self.eval_flow}
        given["env_factory"] = self.env_factory
        return sorted(name for name, value in given.items() if value is not None)


@dataclass(frozen=True)
class BackendKind:
    """One value of ``distributed.backend``.

    ``build``: ``"module:function"``, a ``(config, tokenizer, parts: BackendParts) -> Backends``
    imported on first use. ``remote``: its processes build every model, engine and flow from the
    config alone (objects cannot be passed in; paths are made absolute for other working folders)."""

    build: str
    remote: bool = False


BACKENDS: dict[str, BackendKind] = {
    "none": BackendKind("agent_r1.train.backends:local_backends"),
    "ray": BackendKind("agent_r1.distributed.ray_backends:ray_backends", remote=True),
}


def absolute_paths(config: TrainConfig) -> TrainConfig:
    """Make the paths that actors open absolute: actors may run in another working directory. Model
    paths that do not exist here stay as they are (hub names, or folders that exist only on the nodes)."""

    def local(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path and Path(path).exists() else path

    model = replace(config.model, path=local(config.model.path), tokenizer=local(config.model.tokenizer))
    trainer = replace(config.trainer, run_dir=str(Path(config.trainer.run_dir).resolve()))
    distill = replace(config.algorithm.distill, teacher=local(config.algorithm.distill.teacher))
    algorithm = replace(config.algorithm, distill=distill)
    policies = {name: replace(p, adapter=local(p.adapter)) for name, p in config.policies.items()}
    return replace(config, model=model, trainer=trainer, algorithm=algorithm, policies=policies)


def backend_config(config: TrainConfig, parts: BackendParts | None = None) -> TrainConfig:
    """``config`` as ``distributed.backend`` reads it (a remote backend: absolute paths), checked
    before anything starts: a remote backend refuses objects built here (``parts``)."""
    name = config.distributed.backend
    if not BACKENDS[name].remote:
        return config
    passed = (parts or BackendParts()).objects()
    if passed:
        raise ConfigError(
            "distributed.backend",
            f"{name!r} builds every model, engine and flow in its actors from the config; "
            f"{', '.join(passed)} cannot be passed in (set env.name / env.kwargs instead)",
        )
    return absolute_paths(config)


def make_backends(config: TrainConfig, tokenizer, parts: BackendParts) -> Backends:
    """The rollout and learner backends of ``config`` (``distributed.backend``): in this process, or
    on Ray. ``config`` is ``backend_config``'s (checked against ``parts``, paths made absolute for a
    remote backend); ``parts``: what the caller built (``BackendParts``)."""
    from agent_r1.train.teacher import check_teacher

    check_teacher(config, tokenizer)  # before any model loads
    module, _, function = BACKENDS[config.distributed.backend].build.partition(":")
    return getattr(importlib.import_module(module), function)(config, tokenizer, parts)


def local_backends(config: TrainConfig, tokenizer, parts: BackendParts) -> Backends:
    """The in-process backends: the policy (``parts.model``, or ``load_policy`` on ``model.device``),
    an engine and flows around it (``local_rollout``), its learner and critic (``local_learner``)."""
    from agent_r1.train.builders import check_attention, load_own_models, resolve_device
    from agent_r1.train.policies import policy_model

    check_attention(config)
    configured = resolve_device(config)  # checked also when a model is passed in
    model = parts.model
    if model is None:
        if not config.model.path:
            raise ConfigError("model.path", "no model given: set model.path (or pass model=)")
        model = policy_model(config).to(configured)  # an adapter per policy (agent_r1.train.policies)
    device = next(model.parameters()).device
    own_models = load_own_models(config, device, tokenizer)  # the policies with a model of their own
    rollouts = local_rollout(
        config,
        tokenizer,
        model=model,
        engine=parts.engine,
        flow=parts.flow,
        eval_flow=parts.eval_flow,
        make_env=parts.env_factory,
        with_eval=parts.with_eval,
        background=config.trainer.mode == "async",
        own_models=own_models,
    )
    try:
        learner = local_learner(config, tokenizer, model, device, own_models=own_models)
    except BaseException:
        rollouts.close()
        raise
    if rollouts.owns_engine and not rollouts.shares_model and (parts.model is not None or config.policies):
        # An engine that loaded model.path (vLLM) must start from the policy passed in, and from each
        # trained policy's adapter (it loads none of its own).
        rollouts.update_weights(learner.weights(), 0)
    return Backends(rollouts, learner, model.config, device, model)
