"""The RL trainer: one step is the named phases of DESIGN.md, top to bottom.

    sample tasks -> roll out n samples per task (concurrently) -> score -> filter
    -> reference / old log-probs -> advantages -> update -> sync weights -> log / eval / checkpoint

Choices, and where they come from:

- **Rollout in-process**: the HF engine and the learner share ONE model object by default
  (``rollout.share_model``): weight sync is then a version bump, no copy, no second model in memory.
  ``share_model: false`` gives the engine its own copy, synced after each update by
  ``Engine.update_weights`` (LoRA weights are merged into that copy). Both use exactly the sampler's
  distribution, ``log softmax(logits / temperature)`` over the full vocabulary.
- **Old log-probs** for the PPO ratio: the learner's recomputation before the update (default, so that
  the first mini-batch's ratio is exactly 1) or the sampler's own (``algorithm.old_logprobs:
  sampler``); ``algorithm.tis_cap`` corrects the sampler/learner mismatch (TIS, Yao et al. 2025).
- **Reference** log-probs only when ``algorithm.kl_coef > 0`` (default 0: DAPO and Dr. GRPO drop the
  KL term), used as GRPO's KL loss term; with LoRA the reference is the adapter-disabled policy.
- **Dynamic filtering** (DAPO, arXiv 2503.14476): groups whose rewards all agree carry no gradient
  under group baselines and are dropped. Deviation: DAPO over-samples until the batch is full; this
  trainer trains on the groups that remain (and skips the update when none remain).
- **Sequences** for the loss aggregation are steps (one response = one MDP action), so
  ``seq-mean-*`` aggregations average over steps.
- **Reproducibility**: each request gets a sampling seed derived from (run seed, step, prompt,
  occurrence), each step's tasks are a pure function of (seed, step) and mini-batches are shuffled by
  a generator seeded per step, so a resumed run continues exactly like an uninterrupted one.
- **Error budget** (``agent_r1.train.health``): ERROR trajectories are dropped by the filter, their
  first error of each kind is logged, and a rollout with more than ``trainer.max_error_fraction`` of
  them (or all) stops the run with ``TrainingHalted`` before it trains on the step.
- **Critic** (``gae_token``, ``gae_step`` only): a value head on its own copy of the policy body
  (``agent_r1.train.critic``), trained after the policy on each mini-batch with the clipped value loss.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import inspect
import logging
import math
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from agent_r1.algos import (
    AdvantageConfig,
    PolicyLossConfig,
    StepTable,
    aggregation_weights,
    clipped_value_loss,
    compute_advantages,
    get_policy_loss,
    kl_penalty,
)
from agent_r1.envs.tool_env import tool_count_metrics
from agent_r1.flows.base import AgentEnvLoop, AgentFlow, rollout_groups
from agent_r1.train.batching import (
    StepRows,
    TrainSequence,
    attention_pair_cost,
    build_sequences,
    count_tokens,
    make_micro_batches,
    share_prefixes,
    step_rows,
)
from agent_r1.train.checkpoint import (
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import DataError, TaskSampler, check_fields, load_tasks
from agent_r1.train.health import rollout_health
from agent_r1.train.learner import MASKABLE_KERNELS, Learner, MiniBatch, load_policy
from agent_r1.train.resume import ResumeMode, resume_checkpoint
from agent_r1.train.run_dir import RunDir
from agent_r1.types import SamplingParams, Task, Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = ["Trainer", "evaluate", "train", "trajectory_success"]

logger = logging.getLogger(__name__)

CRITIC_ESTIMATORS = ("gae_token", "gae_step")


def prefix_pair_cost(config: TrainConfig, model_config) -> float | None:
    """The attention weight of the prefix-tree cost model for this policy (``batching``), or None
    where prefix trees are off (``trainer.share_prefixes``) or the attention kernel takes no mask."""
    if not config.trainer.share_prefixes:
        return None
    kernel = getattr(model_config, "_attn_implementation", None) or "sdpa"
    if kernel not in MASKABLE_KERNELS:
        logger.info("prefix trees off: attention kernel %r takes no custom mask", kernel)
        return None
    return attention_pair_cost(model_config)


RewardFn = Callable[[Trajectory, Task], float]


def trajectory_success(trajectory: Trajectory) -> bool:
    """``info["success"]`` when the environment reports it, else a positive total reward."""
    if "success" in trajectory.info:
        return bool(trajectory.info["success"])
    return trajectory.total_reward > 0


class _SeededEngine:
    """Gives every sampled request a seed derived from (base, prompt, occurrence of that prompt).

    Rollouts are concurrent and their requests arrive in a scheduling-dependent order; seeding by
    content instead of arrival makes each step's samples a function of the step's seed. Identical
    prompts get distinct seeds by occurrence, so the n samples of one task differ.
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.base = ""
        self._seen: dict[bytes, int] = {}

    def reseed(self, base: str) -> None:
        self.base = base
        self._seen = {}

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams):
        if not params.greedy:
            digest = hashlib.sha256(repr(tuple(prompt_ids)).encode()).digest()
            k = self._seen.get(digest, 0)
            self._seen[digest] = k + 1
            seed_bytes = hashlib.sha256(f"{self.base}:{k}:".encode() + digest).digest()
            params = replace(params, seed=int.from_bytes(seed_bytes[:7], "little"))
        return await self.engine.generate(prompt_ids, params)

    def update_weights(self, named_tensors, version: int | None = None) -> None:
        self.engine.update_weights(named_tensors, version)


@dataclass(frozen=True)
class StepBatch:
    """A step's kept trajectories as training data (flat token order, see ``agent_r1.train.batching``)."""

    groups: list[TrajectoryGroup]
    trajectories: list[Trajectory]
    rows: StepRows
    sequences: list[TrainSequence]
    tokens: dict[str, Tensor]  # name -> (num_tokens,): mask, sampler_logprobs, old_logprobs, [ref_logprobs]
    valid_NL: Tensor  # (N, L) bool: which padded entries of the StepTable are real tokens

    def to_padded(self, flat: Tensor) -> Tensor:
        out_NL = torch.zeros(self.valid_NL.shape, dtype=flat.dtype)
        out_NL[self.valid_NL] = flat
        return out_NL


class _Timer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[f"time/{phase}"] = (
                self.seconds.get(f"time/{phase}", 0.0) + time.perf_counter() - start
            )


def _rollout_seed(seed: int, step: int, resample: int) -> str:
    """The sampling seed of a step's rollout (``resample``: its DAPO resampling round, 0 for the first)."""
    return f"{seed}:train:{step}" + (f":resample{resample}" if resample else "")


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


class Trainer:
    """RL training from a ``TrainConfig``; every heavy object can also be passed in pre-built.

    Args:
        config: the configuration tree (``agent_r1.train.config``).
        tokenizer: defaults to ``load_tokenizer(model.tokenizer or model.path)``.
        model: the policy; defaults to ``load_policy(config.model)`` (LoRA, dtype, checkpointing).
        env_factory: ``() -> AgentEnv``; defaults to ``make_env(env.name, **env.kwargs)`` (with
            ``tokenizer=`` when the factory takes one).
        flow / eval_flow: any ``AgentFlow``; default ``AgentEnvLoop`` over ``env_factory`` with the
            rollout (or evaluation) sampling settings.
        train_tasks / val_tasks: lists of task dicts (or any ``load_tasks`` source); default
            ``data.train`` / ``data.val``.
        reward_fn: optional ``(trajectory, task) -> float`` that replaces each trajectory's outcome reward.
        engine: a rollout ``Engine``; defaults to an ``HFEngine`` over the policy (see ``share_model``).
        resume: ``True`` continues from the newest checkpoint in ``trainer.run_dir`` that verifies
            and refuses (``ResumeError``) when there is none or when the config differs from the run's
            ``config.yaml``; ``"auto"`` starts fresh when there is none (``agent_r1.train.resume``).
        allow_config_change: resume even though the config differs (the old one is kept).
    """

    def __init__(
        self,
        config: TrainConfig,
        *,
        tokenizer=None,
        model=None,
        env_factory: Callable[[], Any] | None = None,
        flow: AgentFlow | None = None,
        eval_flow: AgentFlow | None = None,
        train_tasks: Any = None,
        val_tasks: Any = None,
        reward_fn: RewardFn | None = None,
        engine=None,
        resume: ResumeMode = False,
        allow_config_change: bool = False,
    ) -> None:
        self.config = config
        # Checked first: a refused resume should not wait for a model to load.
        self.resume_from = resume_checkpoint(config, resume, allow_config_change=allow_config_change)
        algo, rollout, trainer = config.algorithm, config.rollout, config.trainer
        if trainer.torch_threads:
            torch.set_num_threads(trainer.torch_threads)
        torch.manual_seed(trainer.seed)
        if tokenizer is None:
            from agent_r1.models.loading import load_tokenizer

            if not (config.model.tokenizer or config.model.path):
                raise ConfigError(
                    "model.path", "no model given: set model.path (or pass model= and tokenizer=)"
                )
            tokenizer = load_tokenizer(
                config.model.tokenizer or config.model.path,
                key="model.tokenizer" if config.model.tokenizer else "model.path",
            )
        self.tokenizer = tokenizer
        if model is None:
            if not config.model.path:
                raise ConfigError("model.path", "no model given: set model.path (or pass model=)")
            model = load_policy(config.model)
        self.model = model
        self.pair_cost = prefix_pair_cost(config, model.config)

        self.train_tasks = None
        if train_tasks is not None or config.data.train:
            self.train_tasks = self._tasks(train_tasks, config.data.train, config.data.split, "data.train")
        self.val_tasks = None
        if val_tasks is not None or config.data.val:
            self.val_tasks = self._tasks(val_tasks, config.data.val, config.data.val_split, "data.val")
            if config.data.max_val_tasks:
                self.val_tasks = self.val_tasks[: config.data.max_val_tasks]
        self.sampling = SamplingParams(
            temperature=rollout.temperature,
            top_p=rollout.top_p,
            top_k=rollout.top_k,
            max_tokens=rollout.max_tokens,
        )
        self.eval_sampling = replace(self.sampling, temperature=rollout.eval_temperature)
        if flow is None or (eval_flow is None and self.val_tasks is not None):
            env_factory = env_factory or self._env_factory()
        self.flow = flow or self._loop(env_factory, self.sampling)
        self.eval_flow = eval_flow or (self._loop(env_factory, self.eval_sampling) if env_factory else None)
        self.reward_fn = reward_fn

        self._own_engine = engine is None
        self.engine_model = None
        if engine is None:
            from agent_r1.rollout.hf import HFEngine

            self.engine_model = self.model if rollout.share_model else self._engine_copy()
            engine = HFEngine(self.engine_model, tokenizer=tokenizer, max_batch_size=rollout.max_batch_size)
        self.engine = _SeededEngine(engine)

        reference = None
        is_lora = hasattr(model, "peft_config")
        if algo.kl_coef > 0 and not is_lora:
            reference = self._load_reference()
        total_updates = trainer.steps * trainer.ppo_epochs * trainer.mini_batches
        self.learner = Learner(
            model,
            trainer,
            temperature=rollout.temperature,
            total_optimizer_steps=total_updates,
            reference=reference,
        )
        self.critic = None
        if algo.advantage in CRITIC_ESTIMATORS:
            from agent_r1.train.critic import load_critic, micro_batch_values

            self.critic = Learner(
                load_critic(replace(config.model, path=self._base_path())),
                replace(trainer, lr=trainer.critic_lr),
                temperature=rollout.temperature,
                total_optimizer_steps=total_updates,
                forward=micro_batch_values,
            )
        self.policy_loss = get_policy_loss(algo.policy_loss)
        self.policy_loss_config = PolicyLossConfig(
            clip_low=algo.clip_low, clip_high=algo.clip_high, tis_cap=algo.tis_cap
        )
        self.advantage_config = AdvantageConfig(gamma=algo.gamma, lam=algo.lam, norm_by_std=algo.norm_by_std)
        self.policy_version = 0
        self.step = 0
        self.run_dir: RunDir | None = None
        self.resume = resume

    # ------------------------------------------------------------------ construction helpers

    def _tasks(self, given: Any, source: str | None, split: str, key: str) -> list[dict]:
        required = self.config.data.required_fields
        if given is not None:
            if isinstance(given, (list, tuple)):
                tasks = [dict(t) for t in given]
                check_fields(tasks, required, key)
                return tasks
            return load_tasks(given, split=split, required_fields=required)
        if not source:
            raise ConfigError(
                key, "no tasks: set it to a .parquet/.jsonl/.json file or dataset (or pass tasks)"
            )
        try:
            return load_tasks(source, split=split, required_fields=required)
        except DataError as error:
            raise DataError(f"{key}: {error}") from None

    def _env_factory(self) -> Callable[[], Any]:
        """``env.name``'s factory called with ``env.kwargs`` (and ``tokenizer=`` when it takes one). An
        exception while building the env becomes a ``ConfigError`` naming ``env.kwargs``, which feeds
        the construction (the run's halt message, ``agent_r1.train.health``, then points at the config)."""
        from agent_r1.envs.base import AgentEnv
        from agent_r1.envs.registry import get_env_factory

        name, kwargs = self.config.env.name, dict(self.config.env.kwargs)
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
            kwargs["tokenizer"] = self.tokenizer
        configured = sorted(self.config.env.kwargs)  # names only: values may hold credentials

        def build() -> AgentEnv:
            try:
                env = factory(**kwargs)
            except Exception as error:
                raise ConfigError(
                    "env.kwargs",
                    f"building env {name!r} with env.kwargs {configured} raised "
                    f"{type(error).__name__}: {error}",
                ) from error
            if not isinstance(env, AgentEnv):
                raise ConfigError(
                    "env.name", f"{name!r} built a {type(env).__name__}, which is not an agent_r1 AgentEnv"
                )
            return env

        return build

    def _loop(self, env_factory, sampling: SamplingParams) -> AgentEnvLoop:
        return AgentEnvLoop(
            env_factory,
            self.tokenizer,
            sampling,
            max_steps=self.config.rollout.max_steps,
            max_prompt_tokens=self.config.rollout.max_prompt_tokens,
        )

    def _base_path(self) -> str:
        if not self.config.model.path:
            raise ConfigError(
                "model.path",
                "needed to load a second copy of the model (a reference model, a critic, or the "
                "engine's copy with rollout.share_model: false and LoRA)",
            )
        return self.config.model.path

    def _engine_copy(self):
        if hasattr(self.model, "peft_config"):
            from transformers import AutoModelForCausalLM

            from agent_r1.train.learner import DTYPES

            copy_model = AutoModelForCausalLM.from_pretrained(
                self._base_path(), dtype=DTYPES[self.config.model.dtype]
            )
        else:
            copy_model = copy.deepcopy(self.model)
        for p in copy_model.parameters():
            p.requires_grad_(False)
        return copy_model.eval()

    def _load_reference(self):
        from transformers import AutoModelForCausalLM

        from agent_r1.train.learner import DTYPES

        reference = AutoModelForCausalLM.from_pretrained(
            self._base_path(), dtype=DTYPES[self.config.model.dtype]
        )
        for p in reference.parameters():
            p.requires_grad_(False)
        return reference.eval()

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict[str, float]:
        """Train for ``trainer.steps`` steps (continuing from a checkpoint with ``resume``); returns the
        last step's metrics (and the last evaluation's)."""
        cfg = self.config.trainer
        if not self.train_tasks:
            raise ConfigError("data.train", "no training tasks: set data.train (or pass train_tasks=)")
        self.sampler = TaskSampler(
            self.train_tasks, cfg.tasks_per_step, seed=cfg.seed, shuffle=self.config.data.shuffle
        )
        start = self._restore() if self.resume else 0
        self.run_dir = RunDir(cfg.run_dir, self.config, resume_step=start or None)
        last: dict[str, float] = {}
        try:
            with self._progress(start) as advance:
                if start == 0 and cfg.eval_every and self.val_tasks:
                    self.run_dir.log(0, self.evaluate())
                for step in range(start + 1, cfg.steps + 1):
                    self.step = step
                    last = self.train_step(step)
                    self.run_dir.log(step, last)
                    if (
                        cfg.eval_every
                        and self.val_tasks
                        and (step % cfg.eval_every == 0 or step == cfg.steps)
                    ):
                        eval_metrics = self.evaluate()
                        self.run_dir.log(step, eval_metrics)
                        last = {**last, **eval_metrics}
                    if (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps:
                        self.save_checkpoint(step)
                    advance(step, last)
        finally:
            self.run_dir.close()
            self.close()
        if self.config.logging.report:
            self._write_report()
        return last

    def _write_report(self) -> None:
        """``RUN_DIR/report.html`` (``agent-r1 report``). The run is complete on disk by now, so a
        report that cannot be written is logged, not raised: ``agent-r1 report RUN_DIR`` retries it."""
        from agent_r1.report.html import write_report

        try:
            write_report(self.run_dir.path)
        except Exception as error:  # the trained run must not be lost to its report
            logger.warning(
                "could not write %s/report.html: %s: %s", self.run_dir.path, type(error).__name__, error
            )

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step, as named phases; returns its metrics (keys as in CONTRACTS.md)."""
        timer = _Timer()
        with timer("step"):
            tasks = self.sampler.batch(step)
            with timer("rollout"):
                groups = self.rollout(tasks, step)
            with timer("score"):
                groups = self.score(groups, tasks)
            with timer("filter"):
                kept, filter_metrics = self.filter(groups)
            rounds = 0
            while len(kept) < len(tasks) and rounds < self.config.algorithm.resample_rounds:
                rounds += 1
                extra = self.sampler.extra(step, rounds, len(tasks) - len(kept))
                with timer("rollout"):
                    more = self.rollout(extra, step, resample=rounds)
                with timer("score"):
                    more = self.score(more, extra)
                with timer("filter"):
                    more_kept, _ = self.filter(more)
                groups += more
                kept += more_kept[: len(tasks) - len(kept)]
            if self.config.algorithm.resample_rounds:
                filter_metrics["filter/resample_rounds"] = float(rounds)
                filter_metrics["filter/kept_groups"] = float(len(kept))
            metrics = {**self.rollout_metrics(groups), **filter_metrics}
            self.check_health(groups, step)
            advantages_NL = None
            batch = None
            if kept:
                with timer("reference"):
                    batch = self.prepare(kept)
                with timer("advantage"):
                    advantages_NL = self.advantages(batch)
                with timer("update"):
                    metrics.update(self.update(batch, advantages_NL, step))
                with timer("sync"):
                    self.sync_weights()
            else:
                metrics["update/skipped"] = 1.0
        if self.config.logging.dump_trajectories and self.run_dir is not None:
            self.run_dir.dump_trajectories(step, self.annotate(groups, batch, advantages_NL))
        metrics.update(timer.seconds)
        sampled = sum(t.num_response_tokens for g in groups for t in g.trajectories)
        metrics["throughput/tokens_per_s"] = sampled / max(timer.seconds["time/step"], 1e-9)
        return metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> list[TrajectoryGroup]:
        """Phase 1: ``rollout.n`` samples of every task, all concurrently, seeded by (seed, step, and
        the DAPO resampling round if any); each step records the policy version that sampled it."""
        self.engine.reseed(_rollout_seed(self.config.trainer.seed, step, resample))
        groups = asyncio.run(rollout_groups(self.flow, self.engine, tasks, self.config.rollout.n))
        version = self.policy_version
        return [
            replace(
                g,
                trajectories=tuple(
                    replace(t, steps=tuple(replace(s, policy_version=version) for s in t.steps))
                    for t in g.trajectories
                ),
            )
            for g in groups
        ]

    def score(self, groups: list[TrajectoryGroup], tasks: Sequence[Task]) -> list[TrajectoryGroup]:
        """Phase 2: the env already scored each trajectory; ``reward_fn`` (if given) replaces it."""
        if self.reward_fn is None:
            return groups
        return [
            replace(
                g,
                trajectories=tuple(
                    t
                    if t.status is TrajectoryStatus.ERROR
                    else replace(t, outcome_reward=float(self.reward_fn(t, task)))
                    for t in g.trajectories
                ),
            )
            for g, task in zip(groups, tasks, strict=True)
        ]

    def filter(self, groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Phase 3: drop ERROR and empty trajectories; with ``dynamic_filter``, drop groups whose
        rewards all agree (DAPO)."""
        kept = []
        zero_variance = 0
        for group in groups:
            usable = tuple(
                t for t in group.trajectories if t.status is not TrajectoryStatus.ERROR and t.steps
            )
            if not usable:
                continue
            rewards = [t.total_reward for t in usable]
            if max(rewards) - min(rewards) < 1e-9:
                zero_variance += 1
                if self.config.algorithm.dynamic_filter:
                    continue
            kept.append(replace(group, trajectories=usable))
        metrics = {
            "filter/kept_groups": float(len(kept)),
            "filter/zero_variance_groups": float(zero_variance),
        }
        return kept, metrics

    def prepare(self, groups: list[TrajectoryGroup]) -> StepBatch:
        """Phase 4: training sequences, the learner's old log-probs and (with KL) the reference's."""
        trajectories = [t for g in groups for t in g.trajectories]
        rows = step_rows(trajectories)
        sequences = build_sequences(trajectories, merge=True)
        num_tokens = rows.num_tokens
        lengths = torch.tensor([len(s.response_ids) for s in rows.steps])
        width = int(lengths.max()) if len(lengths) else 0
        valid_NL = torch.arange(width)[None, :] < lengths[:, None]
        tokens = {
            "mask": torch.tensor([float(m) for s in rows.steps for m in s.response_mask]),
            "sampler_logprobs": torch.tensor([lp for s in rows.steps for lp in s.logprobs]),
            "seq_ids": torch.tensor([r for r, s in enumerate(rows.steps) for _ in s.response_ids]),
        }
        all_micro_batches = make_micro_batches(
            sequences, rows, self.config.trainer.micro_batch_tokens, pair_cost=self.pair_cost
        )
        single_pass = self.config.trainer.ppo_epochs == 1 and self.config.trainer.mini_batches == 1
        if self.config.algorithm.old_logprobs == "sampler":
            tokens["old_logprobs"] = tokens["sampler_logprobs"]
        elif not single_pass:
            tokens["old_logprobs"] = self.learner.logprobs(all_micro_batches, num_tokens)
        # With one optimizer step per batch the policy has not moved since rollout: the old log-probs
        # are the update's own, detached (``_token_loss``), so their extra forward pass is skipped.
        if self.config.algorithm.kl_coef > 0:
            tokens["ref_logprobs"] = self.learner.logprobs(all_micro_batches, num_tokens, reference=True)
        if self.critic is not None:
            tokens["old_values"] = self.critic.logprobs(all_micro_batches, num_tokens)
            first_token = torch.zeros(num_tokens)
            first_token[[o for o, s in zip(rows.offsets, rows.steps, strict=True) if s.response_ids]] = 1.0
            step_level = self.config.algorithm.advantage == "gae_step"
            tokens["value_mask"] = first_token if step_level else tokens["mask"]
        return StepBatch(groups, trajectories, rows, sequences, tokens, valid_NL)

    def advantages(self, batch: StepBatch) -> Tensor:
        """Phase 5: the configured estimator on the step table; returns advantages (N, L) (and, with a
        critic, stores the value targets in ``batch.tokens["returns"]``)."""
        table = StepTable.from_groups(batch.groups)
        if "old_logprobs" in batch.tokens:
            table = replace(table, old_logprobs=batch.to_padded(batch.tokens["old_logprobs"]))
        if self.critic is not None:
            values_NL = batch.to_padded(batch.tokens["old_values"])
            table = replace(table, token_values=values_NL, step_values=values_NL[:, 0])
        output = compute_advantages(table, self.config.algorithm.advantage, self.advantage_config)
        advantages_NL = output.advantages
        if self.critic is not None:
            batch.tokens["returns"] = output.returns[batch.valid_NL]
        if self.config.algorithm.normalize_advantages:
            live = table.response_mask > 0
            values = advantages_NL[live]
            if values.numel() > 1:
                advantages_NL = torch.where(
                    live, (advantages_NL - values.mean()) / (values.std() + 1e-6), 0.0
                )
        return advantages_NL

    def update(self, batch: StepBatch, advantages_NL: Tensor, step: int) -> dict[str, float]:
        """Phase 6: ``ppo_epochs`` passes, each split into ``mini_batches`` optimizer steps."""
        cfg, algo = self.config.trainer, self.config.algorithm
        tokens = {**batch.tokens, "advantages": advantages_NL[batch.valid_NL]}
        token_traj = torch.tensor(
            [batch.rows.trajectory_index[r] for r, s in enumerate(batch.rows.steps) for _ in s.response_ids],
            dtype=torch.long,
        )
        sequence_traj = [batch.rows.trajectory_index[s.spans[0].row] for s in batch.sequences]
        num_traj = len(batch.trajectories)
        splits = min(cfg.mini_batches, num_traj)
        history: list[dict[str, float]] = []
        for epoch in range(cfg.ppo_epochs):
            generator = torch.Generator().manual_seed(hash_seed(cfg.seed, step, epoch))
            order = torch.randperm(num_traj, generator=generator) if splits > 1 else torch.arange(num_traj)
            for chunk in order.chunk(splits):
                chosen = set(chunk.tolist())
                in_mini = torch.tensor([t in chosen for t in token_traj.tolist()], dtype=torch.float32)
                mask = tokens["mask"] * in_mini
                weights = aggregation_weights(
                    mask,
                    algo.loss_aggregation,
                    seq_ids=tokens["seq_ids"],
                    norm_len=float(self.config.rollout.max_tokens),
                )
                sequences = [s for s, t in zip(batch.sequences, sequence_traj, strict=True) if t in chosen]
                micro_batches = make_micro_batches(
                    sequences, batch.rows, cfg.micro_batch_tokens, pair_cost=self.pair_cost
                )
                mini = MiniBatch(micro_batches, weights, {**tokens, "mask": mask})
                history.append(self.learner.update(mini, self._token_loss, with_entropy=True))
                if self.critic is not None:
                    history[-1].update(self._update_critic(tokens, in_mini, micro_batches))
        metrics = {key: _mean([h[key] for h in history if key in h]) for key in history[0]}
        metrics["update/skipped"] = sum(h["update/skipped"] for h in history)
        trees = share_prefixes(batch.sequences, pair_cost=self.pair_cost, max_width=cfg.micro_batch_tokens)
        metrics["train/tokens"] = float(count_tokens(trees))
        metrics["train/tokens_per_step_layout"] = float(
            sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.rows.steps)
        )
        return metrics

    def _update_critic(self, tokens: dict[str, Tensor], in_mini: Tensor, micro_batches) -> dict[str, float]:
        """The critic's step on the same mini-batch: clipped value loss on the estimator's returns."""
        algo = self.config.algorithm
        value_mask = tokens["value_mask"] * in_mini
        weights = algo.value_coef * aggregation_weights(
            value_mask,
            algo.loss_aggregation,
            seq_ids=tokens["seq_ids"],
            norm_len=float(self.config.rollout.max_tokens),
        )

        def value_loss(values_K, _, tok):
            loss_K, stats = clipped_value_loss(
                values_K, tok["old_values"], tok["returns"], tok["value_mask"], clip=algo.value_clip
            )
            return loss_K, {f"critic/{name}": float(v) for name, v in stats.items()}

        metrics = self.critic.update(
            MiniBatch(micro_batches, weights, {**tokens, "value_mask": value_mask}), value_loss
        )
        renamed = {
            "loss/policy": "loss/value",
            "grad_norm": "critic/grad_norm",
            "lr": "critic/lr",
            "update/skipped": "critic/update_skipped",
        }
        return {renamed.get(k, k): v for k, v in metrics.items()}

    def _token_loss(self, logprobs_K: Tensor, entropy_K: Tensor | None, tokens: Mapping[str, Tensor]):
        algo = self.config.algorithm
        old_logprobs_K = tokens["old_logprobs"] if "old_logprobs" in tokens else logprobs_K.detach()
        loss_K, stats = self.policy_loss(
            logprobs_K,
            old_logprobs_K,
            tokens["advantages"],
            tokens["mask"],
            self.policy_loss_config,
            seq_ids=tokens["seq_ids"],
            sampler_logprobs=tokens["sampler_logprobs"],
        )
        live_K = tokens["mask"] > 0
        denom = live_K.sum().clamp(min=1)
        if algo.kl_coef > 0:
            kl_K = kl_penalty(logprobs_K, tokens["ref_logprobs"], algo.kl_estimator)
            loss_K = loss_K + algo.kl_coef * torch.where(live_K, kl_K, torch.zeros_like(kl_K))
            stats["kl/mean"] = (kl_K.detach() * live_K).sum() / denom
        if entropy_K is not None:
            if algo.entropy_coef > 0:
                loss_K = loss_K - algo.entropy_coef * torch.where(
                    live_K, entropy_K, torch.zeros_like(entropy_K)
                )
            stats["entropy/mean"] = (entropy_K.detach() * live_K).sum() / denom
        return loss_K, {name: float(v) for name, v in stats.items()}

    def sync_weights(self) -> None:
        """Phase 7: the engine samples from the updated policy (a version bump when it shares the model)."""
        self.policy_version += 1
        if self.engine_model is self.model:
            self.engine.engine.weight_version = self.policy_version
            return
        self.engine.update_weights(export_weights(self.model), version=self.policy_version)

    # ------------------------------------------------------------------ metrics, eval, dumps

    def check_health(self, groups: list[TrajectoryGroup], step: int, *, evaluation: bool = False) -> None:
        """The error budget (``agent_r1.train.health``): logs the first error of each kind in a rollout
        and raises ``TrainingHalted`` when more than ``trainer.max_error_fraction`` of its trajectories,
        or all of them, ended in ERROR. A training step's trajectories are dumped first: the dump
        holds every traceback."""
        dump = not evaluation and self.config.logging.dump_trajectories and self.run_dir is not None
        halt = rollout_health(
            groups,
            self.config.trainer.max_error_fraction,
            f"evaluation at step {step}" if evaluation else f"step {step}",
            see=str(self.run_dir.trajectories / f"step_{step:06d}.jsonl") if dump else None,
        )
        if halt is None:
            return
        if dump:
            self.run_dir.dump_trajectories(step, self.annotate(groups, None, None))
        raise halt

    def rollout_metrics(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """The rollout's means over its non-ERROR trajectories; a mean over none is left out, not
        logged as nan (``rollout/error_fraction`` says why it is missing)."""
        trajectories = [t for g in groups for t in g.trajectories]
        ok = [t for t in trajectories if t.status is not TrajectoryStatus.ERROR]
        steps = [s for t in ok for s in t.steps]
        metrics = {
            "reward/mean": _mean([t.total_reward for t in ok]),
            "success/mean": _mean([float(trajectory_success(t)) for t in ok]),
            "response_length/mean": _mean([len(s.response_ids) for s in steps]),
            "steps_per_trajectory/mean": _mean([len(t.steps) for t in ok]),
            "rollout/error_fraction": 1 - len(ok) / max(len(trajectories), 1),
            "rollout/truncated_fraction": _mean([float(t.status is TrajectoryStatus.TRUNCATED) for t in ok]),
        }
        metrics.update(tool_count_metrics(steps))
        return {name: value for name, value in metrics.items() if not math.isnan(value)}

    def evaluate(self) -> dict[str, float]:
        """Mean reward and success rate on the validation tasks (``eval/reward``, ``eval/success``; an
        ERROR trajectory counts as 0 and in ``eval/error_fraction``, within ``check_health``'s budget)."""
        if not self.val_tasks or self.eval_flow is None:
            return {}
        self.engine.reseed(f"{self.config.trainer.seed}:eval:{self.step}")
        groups = asyncio.run(
            rollout_groups(self.eval_flow, self.engine, self.val_tasks, self.config.rollout.eval_n)
        )
        self.check_health(groups, self.step, evaluation=True)
        if self.reward_fn is not None:
            groups = self.score(groups, self.val_tasks)
        trajectories = [t for g in groups for t in g.trajectories]
        return {
            "eval/error_fraction": _mean([float(t.status is TrajectoryStatus.ERROR) for t in trajectories]),
            "eval/reward": _mean(
                [t.total_reward if t.status is not TrajectoryStatus.ERROR else 0.0 for t in trajectories]
            ),
            "eval/success": _mean(
                [
                    float(t.status is not TrajectoryStatus.ERROR and trajectory_success(t))
                    for t in trajectories
                ]
            ),
        }

    def annotate(self, groups, batch: StepBatch | None, advantages_NL: Tensor | None) -> list[Trajectory]:
        """The step's trajectories with the viewer's keys in each Step.info (CONTRACTS.md)."""
        advantage_of: dict[int, float] = {}
        if batch is not None and advantages_NL is not None:
            mask_NL = batch.to_padded(batch.tokens["mask"])
            per_step = (advantages_NL * mask_NL).sum(-1) / mask_NL.sum(-1).clamp(min=1)
            row = 0
            for t in batch.trajectories:
                for s in t.steps:
                    advantage_of[id(s)] = float(per_step[row])
                    row += 1
        decode = self.tokenizer.decode
        out = []
        for group in groups:
            for t in group.trajectories:
                steps = tuple(
                    replace(
                        s,
                        info={
                            **s.info,
                            "prompt_text": decode(list(s.prompt_ids)),
                            "response_tokens": [decode([tok]) for tok in s.response_ids],
                            "advantage": advantage_of.get(id(s), 0.0),
                        },
                    )
                    for s in t.steps
                )
                info = {**t.info, "success": trajectory_success(t)}
                out.append(replace(t, steps=steps, info=info))
        return out

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, step: int) -> Path:
        assert self.run_dir is not None
        trainer_state = {"rng": rng_state(), "policy_version": self.policy_version}
        if self.critic is not None:
            trainer_state["critic"] = {
                "model": self.critic.model.state_dict(),
                "learner": self.critic.state_dict(),
            }
        return save_checkpoint(
            self.run_dir.checkpoints,
            step,
            self.model,
            self.learner.state_dict(),
            trainer_state,
            keep=self.config.trainer.keep_checkpoints,
            tokenizer=self.tokenizer,
        )

    def _restore(self) -> int:
        checkpoint = self.resume_from
        if checkpoint is None:
            return 0
        logger.info("resuming from %s", checkpoint)
        learner_state, trainer_state = load_checkpoint(checkpoint, self.model, verify=False)
        self.learner.load_state_dict(learner_state)
        if self.critic is not None:
            self.critic.model.load_state_dict(trainer_state["critic"]["model"])
            self.critic.load_state_dict(trainer_state["critic"]["learner"])
        set_rng_state(trainer_state["rng"])
        self.policy_version = trainer_state["policy_version"] - 1
        self.sync_weights()
        self.step = trainer_state["step"]
        return self.step

    def close(self) -> None:
        if self._own_engine:
            self.engine.engine.close()

    @contextmanager
    def _progress(self, start: int):
        if not self.config.logging.progress:
            yield lambda step, metrics: None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (
            TextColumn("[bold]step"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn(
                "reward {task.fields[reward]}  success {task.fields[success]}  "
                "{task.fields[tps]} tok/s  {task.fields[sps]} s/step"
            ),
            TimeElapsedColumn(),
        )
        with Progress(*columns) as progress:
            task = progress.add_task(
                "train",
                total=self.config.trainer.steps,
                completed=start,
                reward="-",
                success="-",
                tps="-",
                sps="-",
            )

            def advance(step: int, metrics: Mapping[str, float]) -> None:
                progress.update(
                    task,
                    completed=step,
                    reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                    success=f"{metrics.get('success/mean', float('nan')):.2f}",
                    tps=f"{metrics.get('throughput/tokens_per_s', 0.0):.0f}",
                    sps=f"{metrics.get('time/step', 0.0):.2f}",
                )

            yield advance


def hash_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


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


def train(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """``Trainer(config, **objects).fit()``: train and return the final metrics."""
    return Trainer(config, **objects).fit()


def evaluate(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """Evaluate the configured policy on ``data.val`` (no training); returns eval/reward, eval/success."""
    objects.setdefault("train_tasks", [])  # evaluation reads no training data
    trainer = Trainer(config, **objects)
    try:
        if not trainer.val_tasks:
            raise ConfigError("data.val", "no validation tasks to evaluate on")
        return trainer.evaluate()
    finally:
        trainer.close()
