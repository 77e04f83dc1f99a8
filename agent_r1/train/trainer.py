"""The RL trainer: one step is the named phases of DESIGN.md, top to bottom.

    sample tasks -> roll out n samples per task (concurrently) -> score -> filter
    -> reference / old log-probs -> advantages -> update -> sync weights -> log / eval / checkpoint

The loop exists once and runs on two backends (``agent_r1.train.backends``): a rollout backend and a
learner backend — in this process (``LocalRollout``, ``LocalLearner``) or on Ray
(``distributed.backend: ray``: ``RolloutPool``, ``LearnerGroup``). Every part is made by the builders
of ``agent_r1.train.builders`` and ``agent_r1.rollout.factory``.

Choices, and where they come from:

- **Rollout in-process**: the HF engine and the learner share ONE model object by default
  (``rollout.share_model``): weight sync is then a version bump, no copy, no second model in memory.
  ``share_model: false`` gives the engine its own copy, synced after each update by
  ``Engine.update_weights`` (LoRA weights are merged into that copy); so does ``rollout.engine: vllm``,
  which can also sleep during each update (one GPU). All use exactly the sampler's distribution,
  ``log softmax(logits / temperature)`` over the full vocabulary.
- **Old log-probs** for the PPO ratio: the learner's recomputation before the update (default, so that
  the first mini-batch's ratio is exactly 1) or the sampler's own (``algorithm.old_logprobs:
  sampler``); ``algorithm.off_policy`` corrects the sampler/learner mismatch by name (TIS, masked
  IS per step or trajectory, IcePop: ``agent_r1.algos.off_policy``), once per step.
- **Reference** log-probs only when ``algorithm.kl.coef > 0`` (default 0: DAPO and Dr. GRPO drop the
  KL term), used as GRPO's KL loss term or a reward penalty (``algorithm.kl.penalty``); with LoRA the
  reference is the adapter-disabled policy.
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

import hashlib
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
    StepTable,
    aggregation_weights,
    compute_advantages,
    kl_reward_penalty,
    off_policy_correction,
)
from agent_r1.envs.agent_program import gateway_metrics
from agent_r1.envs.context import SUMMARY_STEP_KEY
from agent_r1.envs.tool_env import tool_count_metrics
from agent_r1.flows.base import AgentFlow
from agent_r1.train import segment_attention
from agent_r1.train.backends import BackendParts, backend_config, local_rollout, make_backends
from agent_r1.train.batching import (
    MicroBatch,
    StepRows,
    attention_pair_cost,
    build_sequences,
    count_tokens,
    pack_trees,
    share_prefixes,
    step_rows,
)
from agent_r1.train.builders import (
    estimator_needs,
    load_config_tokenizer,
    policy_objective,
    resolve_device,
    value_objective,
)
from agent_r1.train.checkpoint import rng_state, set_rng_state
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import DataError, TaskSampler, check_fields, load_tasks
from agent_r1.train.health import ZeroVarianceWatch, rollout_health
from agent_r1.train.learner import MASKABLE_KERNELS, MiniBatch, TokenLoss
from agent_r1.train.process import apply_process_settings
from agent_r1.train.resume import ResumeMode, resume_checkpoint
from agent_r1.train.run_dir import RunDir
from agent_r1.types import Step, Task, Trajectory, TrajectoryGroup, TrajectoryStatus

__all__ = ["Trainer", "evaluate", "evaluation_metrics", "score_groups", "train", "trajectory_success"]

logger = logging.getLogger(__name__)


def prefix_pair_cost(config: TrainConfig, model_config, device: torch.device | str = "cpu") -> float | None:
    """The attention weight of the prefix-tree cost model for this policy (``batching``), or None
    where prefix trees are off (``trainer.share_prefixes``) or the attention kernel takes no mask.

    Where the learner (on ``device``) runs attention segment by segment (``segment_attention``: SDPA
    on the CPU), a tree member attends to what it shares at the cost it would pay alone: joining a
    tree then only saves tokens, so the weight is 0 (every shared prefix is shared). Elsewhere the
    dense tree mask runs, whose attention costs (row width)^2."""
    if not config.trainer.share_prefixes:
        return None
    kernel = config.model.attn_implementation or getattr(model_config, "_attn_implementation", None) or "sdpa"
    if kernel not in MASKABLE_KERNELS:
        logger.info("prefix trees off: attention kernel %r takes no custom mask", kernel)
        return None
    return 0.0 if segment_attention.applies(kernel, device) else attention_pair_cost(model_config)


RewardFn = Callable[[Trajectory, Task], float]


def env_metrics(steps: list[Step]) -> dict[str, float]:
    """``env/<name>``: the mean of each ``Step.metrics`` name over the steps that report it."""
    reported: dict[str, list[float]] = {}
    for step in steps:
        for name, value in step.metrics.items():
            reported.setdefault(name, []).append(value)
    return {f"env/{name}": _mean(values) for name, values in sorted(reported.items())}


def trajectory_success(trajectory: Trajectory) -> bool:
    """``info["success"]`` when the environment reports it, else a positive total reward."""
    if "success" in trajectory.info:
        return bool(trajectory.info["success"])
    return trajectory.total_reward > 0


@dataclass(frozen=True)
class StepBatch:
    """A step's kept trajectories as training data, built once per step by ``prepare``.

    One flat token order (``agent_r1.train.batching``: step rows in order, each row's response tokens
    in order) holds every per-token field; ``table`` is its padded one-row-per-step view (row n's
    tokens are ``valid_NL[n]``), built in the same walk, so the two orders agree by construction. The
    mini-batches are fixed for the step and packed once: ``micro_batches[j]`` are mini-batch j's, and
    their union scores every token exactly once (the old, reference and value passes use it too)."""

    groups: list[TrajectoryGroup]
    trajectories: list[Trajectory]
    rows: StepRows
    table: StepTable
    valid_NL: Tensor  # (N, L) bool: which padded entries of the table are real tokens
    # name -> (num_tokens,): mask, sampler_logprobs, step_ids, traj_ids, [old_logprobs,
    # ref_logprobs, old_values, value_mask, off_policy_weight, off_policy_keep]
    tokens: dict[str, Tensor]
    mini_batch_trajectories: list[Tensor]  # j -> the trajectory ids (table.traj_index) of mini-batch j
    micro_batches: list[list[MicroBatch]]  # j -> mini-batch j's micro-batches
    train_tokens: int  # tokens the layout's forward passes process (a shared prefix counts once)
    metrics: dict[str, float]  # what building it measured (the off-policy correction's)

    def to_padded(self, flat: Tensor) -> Tensor:
        out_NL = torch.zeros(self.valid_NL.shape, dtype=flat.dtype)
        out_NL[self.valid_NL] = flat
        return out_NL

    @property
    def all_micro_batches(self) -> list[MicroBatch]:
        return [mb for mini in self.micro_batches for mb in mini]


@dataclass(frozen=True)
class Advantages:
    """What the estimator returns, per token in the batch's flat order."""

    advantages: Tensor  # (num_tokens,)
    returns: Tensor  # (num_tokens,): the critic's value targets


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


@dataclass
class _InFlight:
    """An async rollout submitted ahead of the step that trains on it (``groups``: restored from a
    checkpoint, already sampled)."""

    step: int
    job: Any = None
    groups: list[TrajectoryGroup] | None = None
    span: tuple[float | None, float | None] = (None, None)  # when it ran (unknown once restored)


class Trainer:
    """RL training from a ``TrainConfig``: the loop, once, over a rollout and a learner backend
    (``agent_r1.train.backends``) — in this process, or on Ray with ``distributed.backend: ray``.

    Args:
        config: the configuration tree (``agent_r1.train.config``).
        tokenizer: defaults to ``load_tokenizer(model.tokenizer or model.path)``.
        model: the policy; defaults to ``load_policy(config.model)`` (LoRA, dtype, checkpointing) on
            ``model.device``.
        env_factory: ``() -> AgentEnv``; defaults to ``env.name``'s factory with ``env.kwargs`` (with
            ``tokenizer=`` when the factory takes one).
        flow / eval_flow: any ``AgentFlow``; default ``AgentEnvLoop`` over ``env_factory`` with the
            rollout (or evaluation) sampling settings.
        train_tasks / val_tasks: lists of task dicts (or any ``load_tasks`` source); default
            ``data.train`` / ``data.val``.
        reward_fn: optional ``(trajectory, task) -> float`` that replaces each trajectory's outcome reward.
        engine: a rollout ``Engine``; defaults to ``rollout.engine`` (the HF engine shares the policy
            with ``rollout.share_model``).
        objective: the policy's per-token loss ``(logprobs_K, entropy_K, tokens) -> (loss_K, stats)``;
            defaults to the configured ``PolicyObjective``. Any picklable callable, also on Ray.
        resume: ``True`` continues from the newest checkpoint in ``trainer.run_dir`` that verifies
            and refuses (``ResumeError``) when there is none or when the config differs from the run's
            ``config.yaml``; ``"auto"`` starts fresh when there is none (``agent_r1.train.resume``).
        allow_config_change: resume even though the config differs (the old one is kept).
        runtime_env: on Ray, the actors' runtime environment (e.g. ``{"env_vars": {"PYTHONPATH": ...}}``
            so that they can import a custom environment's module).

    On Ray, the rollout actors and learner workers build their models, engines and flows from the
    config, so ``model``, ``engine``, ``flow``, ``eval_flow`` and ``env_factory`` cannot be passed.
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
        objective: TokenLoss | None = None,
        resume: ResumeMode = False,
        allow_config_change: bool = False,
        runtime_env: dict | None = None,
    ) -> None:
        # Checked before anything starts: Ray refuses objects built here, and reads absolute paths.
        config = backend_config(config, BackendParts(model, engine, flow, eval_flow, env_factory))
        self.config = config
        # Checked first: a refused resume should not wait for a model to load.
        self.resume_from = resume_checkpoint(config, resume, allow_config_change=allow_config_change)
        trainer = config.trainer
        apply_process_settings(trainer)
        torch.manual_seed(trainer.seed)
        if tokenizer is None and not (config.model.tokenizer or config.model.path):
            raise ConfigError("model.path", "no model given: set model.path (or pass model= and tokenizer=)")
        self.tokenizer = tokenizer if tokenizer is not None else load_config_tokenizer(config)
        self.train_tasks = None
        if train_tasks is not None or config.data.train:
            self.train_tasks = config_tasks(config, train_tasks, "data.train")
        self.val_tasks = None
        if val_tasks is not None or config.data.val:
            self.val_tasks = config_tasks(config, val_tasks, "data.val")
        self.reward_fn = reward_fn
        self.objective = objective or policy_objective(config)
        self.value_objective = value_objective(config)
        backends = make_backends(
            config,
            self.tokenizer,
            model=model,
            engine=engine,
            flow=flow,
            eval_flow=eval_flow,
            env_factory=env_factory,
            with_eval=self.val_tasks is not None,
            runtime_env=runtime_env,
        )
        self.rollouts, self.learner = backends.rollouts, backends.learner
        self.model = backends.model  # the policy, when it lives in this process
        self.pair_cost = prefix_pair_cost(config, backends.model_config, backends.learner_device)
        self.policy_version = 0
        self.engine_version = 0  # the policy version the rollout backend samples with
        self.step = 0
        self.run_dir: RunDir | None = None
        self.resume = resume
        self._in_flight: _InFlight | None = None
        self._rollout_span: tuple[float | None, float | None] = (None, None)
        self.zero_variance = ZeroVarianceWatch()  # warns when nearly every group teaches nothing

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
            metrics = {**self.rollout_metrics(groups), **filter_metrics, **self.staleness_metrics(groups)}
            self.check_health(groups, step)
            warning = self.zero_variance.observe(
                step,
                filter_metrics["filter/zero_variance_groups"],
                len(tasks),
                metrics.get("reward/mean"),
                metrics.get("success/mean"),
            )
            if warning:
                logger.warning(warning)
            advantages = None
            batch = None
            learn_start = time.time()
            if kept:
                with timer("reference"):
                    batch = self.prepare(kept, step)
                with timer("advantage"):
                    advantages = self.advantages(batch)
                with timer("update"):
                    self.rollouts.sleep()  # one GPU: the engine frees its memory for the update
                    metrics.update(self.update(batch, advantages, step))
                with timer("sync"):
                    self.rollouts.wake()
                    self.sync_weights()
            else:
                metrics["update/skipped"] = 1.0
            metrics.update(self._timeline(learn_start, time.time()))
            metrics.update(self.rollouts.metrics())
        if self.config.logging.dump_trajectories and self.run_dir is not None:
            self.run_dir.dump_trajectories(step, self.annotate(groups, batch, advantages))
        metrics.update(timer.seconds)
        sampled = sum(t.num_response_tokens for g in groups for t in g.trajectories)
        metrics["throughput/sampled_tokens"] = float(sampled)
        metrics["throughput/tokens_per_s"] = sampled / max(timer.seconds["time/step"], 1e-9)
        return metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> list[TrajectoryGroup]:
        """Phase 1: ``rollout.n`` samples of every task, all concurrently, seeded by (seed, step, and
        the DAPO resampling round if any); each step records the policy version that sampled it.

        ``trainer.mode: async``: the rollout of step k + 1 is submitted before the update of step k
        and runs while it trains (one-step-off-policy pipelining, as in AReaL, arXiv 2505.24298, and
        verl's one-step-off async trainer), on a rollout thread in this process or on Ray's actors.
        Sampling is paced by the learner, never dropped: at most one rollout runs ahead. With
        ``trainer.partial_rollouts`` every update is pushed into the rollout in flight (its
        trajectories continue with the new weights from their next step, ``sync_weights``);
        otherwise engine weights are refreshed before a rollout is submitted whenever its
        staleness (the version its update starts from minus the version that sampled it) would
        exceed ``trainer.max_staleness``."""
        cfg = self.config.trainer
        if cfg.mode == "sync":
            return self._collect(self._submit(tasks, step, resample))
        if self._in_flight is None or self._in_flight.step != step:
            self._in_flight = _InFlight(step, self._submit(tasks, step))
        groups = self._collect_in_flight()
        self._in_flight = None
        if step < cfg.steps:
            # The next rollout is trained by the update after this one (learner version + 1).
            if self.policy_version + 1 - self.engine_version > cfg.max_staleness:
                self._push_weights()
            self._in_flight = _InFlight(step + 1, self._submit(self.sampler.batch(step + 1), step + 1))
        return groups

    def _collect(self, job: Any) -> list[TrajectoryGroup]:
        groups = self.rollouts.collect(job)
        self._rollout_span = (getattr(job, "started", None), getattr(job, "finished", None))
        return groups

    def _collect_in_flight(self) -> list[TrajectoryGroup]:
        """The rollout in flight's groups (waiting for it; collected once, e.g. by a checkpoint)."""
        in_flight = self._in_flight
        if in_flight.groups is None:
            in_flight.groups = self._collect(in_flight.job)
            in_flight.span = self._rollout_span
        self._rollout_span = in_flight.span
        return in_flight.groups

    def _timeline(self, learn_start: float, learn_end: float) -> dict[str, float]:
        """When the step's rollout and its learning phases ran (``time.time()``, so that a resumed run
        continues the same clock): the report draws them as a timeline, so that the overlap of async
        mode is visible."""
        started, finished = self._rollout_span
        spans = {"rollout": (started, finished), "update": (learn_start, learn_end)}
        return {
            f"timeline/{phase}_{edge}": moment
            for phase, span in spans.items()
            if None not in span
            for edge, moment in zip(("start", "end"), span, strict=True)
        }

    def _submit(self, tasks: Sequence[Task], step: int, resample: int = 0):
        seed = _rollout_seed(self.config.trainer.seed, step, resample)
        return self.rollouts.submit(tasks, self.config.rollout.n, seed)

    def score(self, groups: list[TrajectoryGroup], tasks: Sequence[Task]) -> list[TrajectoryGroup]:
        """Phase 2: the env already scored each trajectory; ``reward_fn`` (if given) replaces it."""
        return score_groups(groups, tasks, self.reward_fn)

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

    def prepare(self, groups: list[TrajectoryGroup], step: int = 0) -> StepBatch:
        """Phase 4: the step's one batch — the flat token layout and its step table, the mini-batches
        (packed once), the learner's old log-probs, (with KL) the reference's and (with a critic)
        the old values."""
        cfg = self.config.trainer
        trajectories = [t for g in groups for t in g.trajectories]
        rows = step_rows(trajectories)
        table = StepTable.from_groups(groups)
        lengths_N = torch.tensor([len(s.response_ids) for s in rows.steps], dtype=torch.long)
        if table.num_steps != len(lengths_N):
            raise AssertionError(f"step table has {table.num_steps} rows, the layout {len(lengths_N)}")
        valid_NL = torch.arange(table.max_response_len)[None, :] < lengths_N[:, None]
        tokens = {
            "mask": table.response_mask[valid_NL],
            "sampler_logprobs": table.old_logprobs[valid_NL],
            "step_ids": torch.arange(len(lengths_N)).repeat_interleave(lengths_N),
            "traj_ids": table.traj_index.repeat_interleave(lengths_N),
        }
        parts = self._mini_batch_trajectories(table, step)
        sequences = build_sequences(trajectories, merge=True)
        sequence_traj = torch.tensor(
            [rows.trajectory_index[s.spans[0].row] for s in sequences], dtype=torch.long
        )
        micro_batches, train_tokens = [], 0
        for part in parts:
            keep = torch.isin(sequence_traj, part).tolist()
            chosen = [s for s, kept in zip(sequences, keep, strict=True) if kept]
            trees = share_prefixes(chosen, pair_cost=self.pair_cost, max_width=cfg.micro_batch_tokens)
            micro_batches.append(pack_trees(trees, rows, cfg.micro_batch_tokens))
            train_tokens += count_tokens(trees)
        batch = StepBatch(
            groups, trajectories, rows, table, valid_NL, tokens, parts, micro_batches, train_tokens, {}
        )
        num_tokens = rows.num_tokens
        off_policy = self.config.algorithm.off_policy
        if self.config.algorithm.old_logprobs == "sampler":
            tokens["old_logprobs"] = tokens["sampler_logprobs"]
        elif cfg.ppo_epochs * len(parts) > 1 or off_policy.name != "none":
            tokens["old_logprobs"] = self.learner.logprobs(batch.all_micro_batches, num_tokens)
        # With one optimizer step per batch the policy has not moved since rollout: the old log-probs
        # are the update's own, detached (``PolicyObjective``), so their extra forward pass is skipped
        # unless the off-policy correction needs them first.
        if off_policy.name != "none":
            weight_T, keep_T, correction_metrics = off_policy_correction(
                tokens["old_logprobs"],
                tokens["sampler_logprobs"],
                tokens["mask"],
                off_policy,
                step_ids=tokens["step_ids"],
                traj_ids=tokens["traj_ids"],
            )
            tokens["off_policy_weight"], tokens["off_policy_keep"] = weight_T, keep_T.float()
            batch.metrics.update(correction_metrics)
        if self.config.algorithm.kl.coef > 0:
            tokens["ref_logprobs"] = self.learner.logprobs(
                batch.all_micro_batches, num_tokens, reference=True
            )
        if self.learner.has_critic:
            tokens["old_values"] = self.learner.values(batch.all_micro_batches, num_tokens)
            if estimator_needs(self.config).critic == "step":  # one value per step: its first token's
                first_T = torch.zeros(num_tokens)
                first_T[(lengths_N.cumsum(0) - lengths_N)[lengths_N > 0]] = 1.0
                tokens["value_mask"] = first_T
            else:
                tokens["value_mask"] = tokens["mask"]
        return batch

    def _mini_batch_trajectories(self, table: StepTable, step: int) -> list[Tensor]:
        """The step's ``trainer.mini_batches`` parts as trajectory ids, drawn once per step (seeded by
        (seed, step)). Whole groups stay in one mini-batch whenever there are at least as many groups
        as mini-batches, so a group's shared prompt is laid out once; else trajectories are split."""
        traj_T = torch.unique(table.traj_index)
        splits = min(self.config.trainer.mini_batches, len(traj_T))
        if splits <= 1:
            return [traj_T]
        generator = torch.Generator().manual_seed(hash_seed(self.config.trainer.seed, step))
        group_of_T = torch.zeros(int(traj_T.max()) + 1, dtype=torch.long)
        group_of_T[table.traj_index] = table.group_index
        group_ids = torch.unique(table.group_index)
        if len(group_ids) >= splits:
            shuffled = group_ids[torch.randperm(len(group_ids), generator=generator)]
            return [traj_T[torch.isin(group_of_T[traj_T], part)] for part in shuffled.chunk(splits)]
        return list(traj_T[torch.randperm(len(traj_T), generator=generator)].chunk(splits))

    def advantages(self, batch: StepBatch) -> Advantages:
        """Phase 5: the configured estimator (``algorithm.advantage``) on the step table, with the
        learner's old log-probs, the critic's values and (``algorithm.kl.penalty: reward``) the KL
        penalty in the rewards."""
        table, tokens = batch.table, batch.tokens
        if "old_logprobs" in tokens:
            table = replace(table, old_logprobs=batch.to_padded(tokens["old_logprobs"]))
        if self.learner.has_critic:
            values_NL = batch.to_padded(tokens["old_values"])
            table = replace(table, token_values=values_NL, step_values=values_NL[:, 0])
        kl = self.config.algorithm.kl
        if kl.coef > 0 and kl.penalty == "reward":
            table = kl_reward_penalty(
                replace(table, ref_logprobs=batch.to_padded(tokens["ref_logprobs"])), kl.coef, kl.estimator
            )
        output = compute_advantages(table, self.config.algorithm.advantage)
        return Advantages(output.advantages[batch.valid_NL], output.returns[batch.valid_NL])

    def update(self, batch: StepBatch, advantages: Advantages, step: int) -> dict[str, float]:
        """Phase 6: ``ppo_epochs`` passes over the step's mini-batches (in a fresh order each epoch),
        one optimizer step each."""
        cfg = self.config.trainer
        tokens = {**batch.tokens, "advantages": advantages.advantages}
        if self.learner.has_critic:  # every field is gathered to every micro-batch: only what is read
            tokens["returns"] = advantages.returns
        history: list[dict[str, float]] = []
        splits = len(batch.micro_batches)
        for epoch in range(cfg.ppo_epochs):
            generator = torch.Generator().manual_seed(hash_seed(cfg.seed, step, epoch))
            order = torch.randperm(splits, generator=generator).tolist() if splits > 1 else [0]
            for j in order:
                in_mini_T = torch.isin(tokens["traj_ids"], batch.mini_batch_trajectories[j]).float()
                # A token the off-policy correction dropped leaves the loss and its denominators.
                mask = tokens["mask"] * in_mini_T * tokens.get("off_policy_keep", 1.0)
                mini = MiniBatch(
                    batch.micro_batches[j], self._weights(mask, tokens), {**tokens, "mask": mask}
                )
                history.append(self.learner.update(mini, self.objective, with_entropy=True))
                if self.learner.has_critic:
                    history[-1].update(self._update_critic(tokens, in_mini_T, batch.micro_batches[j]))
        metrics = {key: _mean([h[key] for h in history if key in h]) for key in history[0]}
        metrics["update/skipped"] = sum(h["update/skipped"] for h in history)
        metrics.update(batch.metrics)
        metrics["train/tokens"] = float(batch.train_tokens)
        metrics["train/tokens_per_step_layout"] = float(
            sum(len(s.prompt_ids) + len(s.response_ids) for s in batch.rows.steps)
        )
        return metrics

    def _weights(self, mask: Tensor, tokens: Mapping[str, Tensor]) -> Tensor:
        """The configured loss aggregation (``algorithm.loss_aggregation``) as per-token weights over
        ``mask``'s tokens; sequences are steps."""
        aggregation = self.config.algorithm.loss_aggregation
        return aggregation_weights(
            mask,
            aggregation.name,
            seq_ids=tokens["step_ids"],
            traj_ids=tokens["traj_ids"],
            norm_len=aggregation.norm_len or float(self.config.rollout.max_tokens),
            equal_trajectory_weight=aggregation.equal_trajectory_weight,
        )

    def _update_critic(self, tokens: dict[str, Tensor], in_mini: Tensor, micro_batches) -> dict[str, float]:
        """The critic's step on the same mini-batch: clipped value loss on the estimator's returns."""
        value_mask = tokens["value_mask"] * in_mini
        metrics = self.learner.update_critic(
            MiniBatch(micro_batches, self._weights(value_mask, tokens), {**tokens, "value_mask": value_mask}),
            self.value_objective,
        )
        renamed = {
            "loss/policy": "loss/value",
            "grad_norm": "critic/grad_norm",
            "lr": "critic/lr",
            "update/skipped": "critic/update_skipped",
        }
        return {renamed.get(k, k): v for k, v in metrics.items()}

    def sync_weights(self) -> None:
        """Phase 7: a new policy version; sync mode and partial rollouts give it to the rollout backend
        now (a rollout in flight takes it between requests), async mode without partial rollouts
        when the staleness bound requires (``rollout``)."""
        self.policy_version += 1
        if self.config.trainer.mode == "sync" or self.config.trainer.partial_rollouts:
            self._push_weights()

    def _push_weights(self) -> None:
        self.rollouts.update_weights(self.learner.weights(), self.policy_version)
        self.engine_version = self.policy_version

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
            # status OK covers both endings; these ran out of steps (the env's or the flow's limit)
            "rollout/step_limit_fraction": _mean(
                [
                    float(t.status is TrajectoryStatus.OK and bool(t.steps) and t.steps[-1].truncated)
                    for t in ok
                ]
            ),
        }
        summaries = [sum(SUMMARY_STEP_KEY in s.info for s in t.steps) for t in ok]
        if any(summaries):  # trained summary steps (``summarize``), counted in steps_per_trajectory too
            metrics["context/summary_steps_per_trajectory"] = _mean(summaries)
        metrics.update(tool_count_metrics(steps))
        metrics.update(gateway_metrics(ok))
        metrics.update(env_metrics(steps))
        return {name: value for name, value in metrics.items() if not math.isnan(value)}

    def staleness_metrics(self, groups: list[TrajectoryGroup]) -> dict[str, float]:
        """How many policy versions the step's samples lag the policy their update starts from (read
        before the update)."""
        trajectories = [t for g in groups for t in g.trajectories if t.steps]
        staleness = [self.policy_version - s.policy_version for t in trajectories for s in t.steps]
        if not staleness:
            return {}
        mixed = [float(len({s.policy_version for s in t.steps}) > 1) for t in trajectories]
        return {
            "async/staleness_mean": _mean(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/mixed_version_fraction": _mean(mixed),  # trajectories a weight update landed in
        }

    def evaluate(self) -> dict[str, float]:
        """Mean reward and success rate on the validation tasks (``eval/reward``, ``eval/success``; an
        ERROR trajectory counts as 0 and in ``eval/error_fraction``, within ``check_health``'s budget),
        sampled with the newest weights."""
        if not self.val_tasks:
            return {}
        if self._in_flight is not None:
            # The evaluation samples with the newest weights only: the in-flight rollout completes
            # first (the step that trains on it takes its stored result).
            self._collect_in_flight()
        if self.engine_version != self.policy_version:
            self._push_weights()
        base = f"{self.config.trainer.seed}:eval:{self.step}"
        job = self.rollouts.submit(self.val_tasks, self.config.rollout.eval_n, base, evaluation=True)
        groups = self.rollouts.collect(job)
        self.check_health(groups, self.step, evaluation=True)
        return evaluation_metrics(score_groups(groups, self.val_tasks, self.reward_fn))

    def annotate(self, groups, batch: StepBatch | None, advantages: Advantages | None) -> list[Trajectory]:
        """The step's trajectories with the viewer's keys in each Step.info (CONTRACTS.md)."""
        advantage_of: dict[int, float] = {}
        if batch is not None and advantages is not None:
            mask_T, step_T = batch.tokens["mask"], batch.tokens["step_ids"]
            num_steps = len(batch.rows.steps)
            summed_N = torch.zeros(num_steps).index_add_(0, step_T, advantages.advantages * mask_T)
            per_step_N = summed_N / torch.zeros(num_steps).index_add_(0, step_T, mask_T).clamp(min=1)
            advantage_of = {id(s): v for s, v in zip(batch.rows.steps, per_step_N.tolist(), strict=True)}
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
        if self._in_flight is not None:
            # Async: the next step's rollout is finished and saved with the checkpoint, so a resumed
            # run trains exactly those samples — none lost, none sampled twice.
            trainer_state["in_flight"] = {"step": self._in_flight.step, "groups": self._collect_in_flight()}
        return Path(self.learner.save_checkpoint(self.run_dir.checkpoints, step, trainer_state))

    def _restore(self) -> int:
        checkpoint = self.resume_from
        if checkpoint is None:
            return 0
        logger.info("resuming from %s", checkpoint)
        trainer_state = self.learner.load_checkpoint(checkpoint)
        set_rng_state(trainer_state["rng"])
        self.policy_version = trainer_state["policy_version"]
        self._push_weights()
        self.step = trainer_state["step"]
        in_flight = trainer_state.get("in_flight")
        if in_flight is not None and self.config.trainer.mode == "async":
            self._in_flight = _InFlight(in_flight["step"], groups=in_flight["groups"])
        return self.step

    def close(self) -> None:
        """Release the backends (engines, Ray actors and workers, a local Ray cluster it started)."""
        try:
            self.rollouts.close()
        finally:
            self.learner.close()

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


def config_tasks(config: TrainConfig, given: Any, key: str) -> list[dict]:
    """The tasks of ``key`` (``data.train`` or ``data.val``): ``given`` (a list of task dicts, or any
    ``load_tasks`` source) or else the configured source, with ``data.required_fields`` checked; the
    validation tasks cut to ``data.max_val_tasks``. A data error names the key."""
    data = config.data
    split, source = (data.split, data.train) if key == "data.train" else (data.val_split, data.val)
    if isinstance(given, (list, tuple)):
        tasks = [dict(t) for t in given]
        check_fields(tasks, data.required_fields, key)
    elif given is not None:
        tasks = load_tasks(given, split=split, required_fields=data.required_fields)
    elif not source:
        raise ConfigError(key, "no tasks: set it to a .parquet/.jsonl/.json file or dataset (or pass tasks)")
    else:
        try:
            tasks = load_tasks(source, split=split, required_fields=data.required_fields)
        except DataError as error:
            raise DataError(f"{key}: {error}") from None
    if key == "data.val" and data.max_val_tasks:
        tasks = tasks[: data.max_val_tasks]
    return tasks


def hash_seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


def score_groups(
    groups: list[TrajectoryGroup], tasks: Sequence[Task], reward_fn: RewardFn | None
) -> list[TrajectoryGroup]:
    """``reward_fn(trajectory, task)`` as each non-ERROR trajectory's outcome reward (None: unchanged)."""
    if reward_fn is None:
        return groups
    return [
        replace(
            g,
            trajectories=tuple(
                t
                if t.status is TrajectoryStatus.ERROR
                else replace(t, outcome_reward=float(reward_fn(t, task)))
                for t in g.trajectories
            ),
        )
        for g, task in zip(groups, tasks, strict=True)
    ]


def evaluation_metrics(groups: list[TrajectoryGroup]) -> dict[str, float]:
    """``eval/reward`` and ``eval/success`` over every trajectory (ERROR ones count as 0) and
    ``eval/error_fraction``."""
    trajectories = [t for g in groups for t in g.trajectories]
    ok = [t.status is not TrajectoryStatus.ERROR for t in trajectories]
    return {
        "eval/error_fraction": _mean([float(not k) for k in ok]),
        "eval/reward": _mean([t.total_reward if k else 0.0 for t, k in zip(trajectories, ok, strict=True)]),
        "eval/success": _mean(
            [float(k and trajectory_success(t)) for t, k in zip(trajectories, ok, strict=True)]
        ),
    }


def train(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """``Trainer(config, **objects).fit()``: train and return the final metrics."""
    return Trainer(config, **objects).fit()


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
) -> dict[str, float]:
    """Evaluate the configured policy (``model``, or ``model.path``) on ``data.val`` and return
    eval/reward, eval/success, eval/error_fraction. Builds only the rollout side: no learner, no
    optimizer, no reference."""
    if tokenizer is None:
        tokenizer = load_config_tokenizer(config)
    if val_tasks is None and not config.data.val:
        raise ConfigError("data.val", "no validation tasks to evaluate on")
    tasks = config_tasks(config, val_tasks, "data.val")
    if not tasks:
        raise ConfigError("data.val", "no validation tasks to evaluate on")
    device = resolve_device(config)
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
    )
    try:
        job = rollouts.submit(tasks, config.rollout.eval_n, f"{config.trainer.seed}:eval:0", evaluation=True)
        groups = rollouts.collect(job)
    finally:
        rollouts.close()
    halt = rollout_health(groups, config.trainer.max_error_fraction, "evaluation at step 0")
    if halt is not None:
        raise halt
    return evaluation_metrics(score_groups(groups, tasks, reward_fn))
