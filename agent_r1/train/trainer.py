"""The RL trainer: one step is a sequence of named, timed phases, top to bottom.

    sample tasks -> rollout -> score -> filter -> batch -> old log-probs -> reference -> values
    -> advantages -> update -> sync weights -> log / eval / checkpoint

The loop exists once and runs on two backends (``agent_r1.train.backends``): a rollout backend and a
learner backend, in this process or on Ray (``distributed.backend: ray``). The step's training data
is one ``agent_r1.train.batch.TrainBatch``, built once from the kept groups; each phase after it
returns its per-token result and the batch is enriched with it (``with_tokens``), never mutated.

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
  under group baselines and are dropped; with ``algorithm.resample_rounds`` fresh tasks are rolled
  out until the batch is full (DAPO's over-sampling), otherwise the step trains on what remains
  (and skips the update when nothing does).
- **Sequences** for the loss aggregation are steps (one response = one MDP action), so
  ``seq-mean-*`` aggregations average over steps.
- **Reproducibility**: each request gets a sampling seed derived from (run seed, step, task, sample,
  prompt; ``agent_r1.rollout.seeded``), each step's tasks are a pure function of (seed, step) and
  mini-batches are shuffled by a generator seeded per step (docs/training.md says what a rerun and a
  resumed run reproduce; ``trainer.deterministic`` makes them bitwise).
- **Preemption** (``agent_r1.train.preemption``): SIGTERM / SIGINT stop a sync rollout or finish the
  step in progress, checkpoint the last finished step and raise ``Preempted`` (CLI exit 4).
- **Error budget** (``agent_r1.train.health``): ERROR trajectories are dropped by the filter, their
  first error of each kind is logged, and a rollout with more than ``trainer.max_error_fraction`` of
  them (or all) stops the run with ``TrainingHalted`` before it trains on the step.
- **Critic** (``gae_token``, ``gae_step`` only): a value head on its own copy of the policy body
  (``agent_r1.train.critic``), trained after the policy on each mini-batch with the clipped value loss.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from agent_r1.algos import compute_advantages, distill_advantages, kl_reward_penalty, off_policy_correction
from agent_r1.flows.base import AgentFlow
from agent_r1.report.annotate import annotate
from agent_r1.report.html import write_finished_report
from agent_r1.train.backends import BackendParts, backend_config, make_backends
from agent_r1.train.batch import TrainBatch, build_batch, keep_groups, prefix_pair_cost
from agent_r1.train.builders import (
    check_env,
    estimator_needs,
    load_config_tokenizer,
    policy_objective,
    value_objective,
)
from agent_r1.train.checkpoint import rng_state, set_rng_state
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import TaskSampler, config_tasks
from agent_r1.train.evaluation import evaluate_rollouts
from agent_r1.train.health import ZeroVarianceWatch, error_budget
from agent_r1.train.learner import TokenLoss
from agent_r1.train.preemption import Preempted, PreemptionGuard, StopSampling
from agent_r1.train.process import apply_process_settings
from agent_r1.train.progress import progress_bar
from agent_r1.train.resume import ResumeMode, resume_checkpoint
from agent_r1.train.run_dir import RunDir
from agent_r1.train.summary import (
    RewardFn,
    RolloutSummary,
    score_groups,
    summarize_rollout,
    trajectory_success,
)
from agent_r1.train.teacher import is_server, server_teacher_logprobs
from agent_r1.train.update import ppo_update
from agent_r1.types import Task, TrajectoryGroup

__all__ = ["Trainer", "train"]

logger = logging.getLogger(__name__)


class _Timer:
    """``time/<phase>``: seconds per named phase of a step (summed when a phase runs twice)."""

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
        overwrite: bool = False,
    ) -> None:
        # Checked before anything starts: Ray refuses objects built here, and reads absolute paths.
        config = backend_config(config, BackendParts(model, engine, flow, eval_flow, env_factory))
        self.config = config
        # Checked first: a refused resume should not wait for a model to load.
        self.resume_from = resume_checkpoint(
            config, resume, allow_config_change=allow_config_change, overwrite=overwrite
        )
        if env_factory is None and flow is None and config.distributed.backend == "none":
            check_env(config)  # a bad agent or env kwarg is refused before the model loads
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
        self.preemption = PreemptionGuard(trainer.preemption_grace_s)  # installed by fit
        self._saved_step = 0  # the newest checkpoint written by this process or resumed from

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
        self._saved_step = start
        self.run_dir = RunDir(cfg.run_dir, self.config, resume_step=start or None)
        last: dict[str, float] = {}
        try:
            with self.preemption, progress_bar(cfg.steps, start, self.config.logging.progress) as advance:
                if start == 0 and cfg.eval_every and self.val_tasks:
                    self.run_dir.log(0, self.evaluate())
                ended_rng = rng_state()  # the RNG state where the last step ended (a checkpoint's)
                for step in range(start + 1, cfg.steps + 1):
                    self.step = step
                    try:
                        last = self.train_step(step)
                    except StopSampling:  # preempted mid-rollout: the state is the previous step's
                        self._preempted(step - 1, ended_rng)
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
                    ended_rng = rng_state()
                    if self.preemption.requested and step < cfg.steps:
                        self._preempted(step, ended_rng)
                    advance(step, last)
        finally:
            self.run_dir.close()
            self.close()
        if self.config.logging.report:
            write_finished_report(self.run_dir.path)
        return last

    def train_step(self, step: int) -> dict[str, float]:
        """One RL step as named phases (numbered as in docs/training.md, "One training step"), each
        timed as ``time/<phase>``; returns the step's metrics."""
        timer = _Timer()
        with timer("step"):
            tasks = self.sampler.batch(step)
            groups, kept, metrics = self.collect_groups(tasks, step, timer)
            batch = None
            learn_start = time.time()
            if kept:
                with timer("batch"):
                    batch = self.batch(kept, step)
                with timer("old_logprobs"):
                    batch, correction_metrics = self.old_logprobs(batch)
                with timer("reference"):
                    batch = self.reference(batch)
                with timer("values"):
                    batch = self.values(batch)
                with timer("advantage"):
                    batch = self.advantages(batch)
                with timer("teacher"):
                    batch = self.distill(batch, metrics)
                with timer("update"):
                    self.rollouts.sleep()  # one GPU: the engine frees its memory for the update
                    metrics.update(self.update(batch, step), **correction_metrics)
                with timer("sync"):
                    self.rollouts.wake()
                    self.sync_weights()
            else:
                metrics["update/skipped"] = 1.0
            metrics.update(self._timeline(learn_start, time.time()))
            metrics.update(self.rollouts.metrics())
            metrics.update(self.learner.metrics())
        if self.config.logging.dump_trajectories and self.run_dir is not None:
            self.run_dir.dump_trajectories(step, self.annotate(groups, batch))
        metrics.update(timer.seconds)
        metrics["throughput/tokens_per_s"] = metrics["throughput/sampled_tokens"] / max(
            timer.seconds["time/step"], 1e-9
        )
        return metrics

    def collect_groups(self, tasks: Sequence[Task], step: int, timer: _Timer):
        """Phases 2-4 (rollout, score, filter), repeated for DAPO's resampling rounds; returns every
        group rolled out, the kept ones and the rollout's metrics, after the error budget's check."""
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
        summary = summarize_rollout(groups, self.policy_version)
        metrics = {**summary.metrics, **filter_metrics}
        self.check_health(summary, groups, step)
        warning = self.zero_variance.observe(
            step,
            filter_metrics["filter/zero_variance_groups"],
            len(tasks),
            metrics.get("reward/mean"),
            metrics.get("success/mean"),
        )
        if warning:
            logger.warning(warning)
        return groups, kept, metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> list[TrajectoryGroup]:
        """Phase 2: ``rollout.n`` samples of every task, all concurrently, seeded by (seed, step, and
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
            with self.preemption.stoppable():  # a preemption signal stops a sync rollout
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
        """A rollout seeded by (seed, step) and ``resample``, its DAPO resampling round (0: the first)."""
        seed = f"{self.config.trainer.seed}:train:{step}" + (f":resample{resample}" if resample else "")
        return self.rollouts.submit(tasks, self.config.rollout.n, seed)

    def score(self, groups: list[TrajectoryGroup], tasks: Sequence[Task]) -> list[TrajectoryGroup]:
        """Phase 3: the env already scored each trajectory; ``reward_fn`` (if given) replaces it."""
        return score_groups(groups, tasks, self.reward_fn)

    def filter(self, groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Phase 4: the groups that train (``agent_r1.train.batch.keep_groups``)."""
        return keep_groups(groups, dynamic_filter=self.config.algorithm.dynamic_filter)

    def batch(self, groups: list[TrajectoryGroup], step: int) -> TrainBatch:
        """Phase 5: the step's one batch (``agent_r1.train.batch``): token layout, step table,
        mini-batches and their packed micro-batches."""
        cfg = self.config.trainer
        return build_batch(
            groups,
            mini_batches=cfg.mini_batches,
            micro_batch_tokens=cfg.micro_batch_tokens,
            pair_cost=self.pair_cost,
            seed=cfg.seed,
            step=step,
        )

    def old_logprobs(self, batch: TrainBatch) -> tuple[TrainBatch, dict[str, float]]:
        """Phase 6: PPO's old log-probs and (``algorithm.off_policy``) the off-policy correction.

        With one optimizer step per batch the policy has not moved since the rollout: the old
        log-probs are the update's own, detached (``PolicyObjective``), so their extra forward pass is
        skipped unless the off-policy correction needs them first."""
        algorithm, tokens = self.config.algorithm, batch.tokens
        off_policy = algorithm.off_policy
        if algorithm.old_logprobs == "sampler":
            batch = batch.with_tokens(old_logprobs=tokens.sampler_logprobs)
        elif self.config.trainer.ppo_epochs * len(batch.micro_batches) > 1 or off_policy.name != "none":
            batch = batch.with_tokens(
                old_logprobs=self.learner.logprobs(batch.all_micro_batches, batch.num_tokens)
            )
        if off_policy.name == "none":
            return batch, {}
        weight_T, keep_T, metrics = off_policy_correction(
            batch.tokens.old_logprobs,
            tokens.sampler_logprobs,
            tokens.mask,
            off_policy,
            step_ids=tokens.step_ids,
            traj_ids=tokens.traj_ids,
        )
        return batch.with_tokens(off_policy_weight=weight_T, off_policy_keep=keep_T.float()), metrics

    def reference(self, batch: TrainBatch) -> TrainBatch:
        """Phase 7: the frozen reference policy's log-probs, for the KL term (``algorithm.kl.coef > 0``)."""
        if self.config.algorithm.kl.coef <= 0:
            return batch
        ref_T = self.learner.logprobs(batch.all_micro_batches, batch.num_tokens, reference=True)
        return batch.with_tokens(ref_logprobs=ref_T)

    def values(self, batch: TrainBatch) -> TrainBatch:
        """Phase 8: the critic's values before the update, and the tokens its loss reads: each step's
        first token with a step-level critic, every trained token with a token-level one."""
        if not self.learner.has_critic:
            return batch
        values_T = self.learner.values(batch.all_micro_batches, batch.num_tokens)
        value_mask_T = batch.tokens.mask
        if estimator_needs(self.config).critic == "step":  # one value per step: its first token's
            value_mask_T = torch.zeros(batch.num_tokens)
            lengths_N = batch.valid_NL.sum(1)
            value_mask_T[(lengths_N.cumsum(0) - lengths_N)[lengths_N > 0]] = 1.0
        return batch.with_tokens(old_values=values_T, value_mask=value_mask_T)

    def advantages(self, batch: TrainBatch) -> TrainBatch:
        """Phase 9: the configured estimator (``algorithm.advantage``) on the step table, with the
        learner's old log-probs, the critic's values and (``algorithm.kl.penalty: reward``) the KL
        penalty in the rewards; the advantages and the critic's returns join the batch."""
        table, tokens = batch.table, batch.tokens
        if tokens.old_logprobs is not None:
            table = replace(table, old_logprobs=batch.to_padded(tokens.old_logprobs))
        if tokens.old_values is not None:
            values_NL = batch.to_padded(tokens.old_values)
            table = replace(table, token_values=values_NL, step_values=values_NL[:, 0])
        kl = self.config.algorithm.kl
        if kl.coef > 0 and kl.penalty == "reward":
            table = kl_reward_penalty(
                replace(table, ref_logprobs=batch.to_padded(tokens.ref_logprobs)), kl.coef, kl.estimator
            )
        output = compute_advantages(table, self.config.algorithm.advantage)
        returns = output.returns[batch.valid_NL] if self.learner.has_critic else None
        return batch.with_tokens(advantages=output.advantages[batch.valid_NL], returns=returns)

    def distill(self, batch: TrainBatch, metrics: dict[str, float]) -> TrainBatch:
        """Phase 9b (``algorithm.distill``, on-policy distillation): the teacher's log-probs of the
        sampled tokens (``agent_r1.train.teacher``: the learner's local teacher over the packed
        micro-batches, or a server scoring each step's prompt + response), and ``-coef`` x the
        per-token reverse KL against the sampler's log-probs (each step's own policy version) added
        to the advantages (``agent_r1.algos.distill``); logs ``distill/reverse_kl``, its mean per
        action token."""
        distill = self.config.algorithm.distill
        if not distill.teacher:
            return batch
        tokens = batch.tokens
        if is_server(distill):
            teacher_T = server_teacher_logprobs(
                distill, batch.rows.steps, batch.rows.offsets, batch.num_tokens
            )
        else:
            teacher_T = self.learner.teacher_logprobs(batch.all_micro_batches, batch.num_tokens)
        advantages_T, rkl_T = distill_advantages(
            tokens.advantages,
            tokens.sampler_logprobs,
            teacher_T,
            tokens.mask,
            coef=distill.coef,
            reward_weight=distill.reward_weight,
        )
        metrics["distill/reverse_kl"] = float(rkl_T.sum() / tokens.mask.sum().clamp(min=1))
        return batch.with_tokens(teacher_logprobs=teacher_T, advantages=advantages_T)

    def update(self, batch: TrainBatch, step: int) -> dict[str, float]:
        """Phase 10: PPO's epochs over the step's mini-batches (``agent_r1.train.update``)."""
        return ppo_update(self.learner, batch, step, self.config, self.objective, self.value_objective)

    def sync_weights(self) -> None:
        """Phase 11: a new policy version; sync mode and partial rollouts give it to the rollout backend
        now (a rollout in flight takes it between requests), async mode without partial rollouts
        when the staleness bound requires (``rollout``)."""
        self.policy_version += 1
        if self.config.trainer.mode == "sync" or self.config.trainer.partial_rollouts:
            self._push_weights()

    def _push_weights(self) -> None:
        self.rollouts.update_weights(self.learner.weights(), self.policy_version)
        self.engine_version = self.policy_version

    # ------------------------------------------------------------------ health, eval, dumps

    def check_health(self, summary: RolloutSummary, groups: list[TrajectoryGroup], step: int) -> None:
        """The error budget (``agent_r1.train.health``): logs the first error of each kind in a rollout
        and raises ``TrainingHalted`` when more than ``trainer.max_error_fraction`` of its trajectories,
        or all of them, ended in ERROR. The step's trajectories are dumped first: the dump holds every
        traceback."""
        dump = self.config.logging.dump_trajectories and self.run_dir is not None
        halt = error_budget(
            summary.error_kinds,
            summary.trajectories,
            self.config.trainer.max_error_fraction,
            f"step {step}",
            see=str(self.run_dir.trajectories / f"step_{step:06d}.jsonl") if dump else None,
        )
        if halt is None:
            return
        if dump:
            self.run_dir.dump_trajectories(step, self.annotate(groups, None))
        raise halt

    def evaluate(self) -> dict[str, float]:
        """``agent_r1.train.evaluation.evaluate_rollouts`` on the validation tasks, sampled with the
        newest weights."""
        if not self.val_tasks:
            return {}
        if self._in_flight is not None:
            # The evaluation samples with the newest weights only: the in-flight rollout completes
            # first (the step that trains on it takes its stored result).
            self._collect_in_flight()
        if self.engine_version != self.policy_version:
            self._push_weights()
        return evaluate_rollouts(
            self.rollouts, self.val_tasks, self.config, self.step, reward_fn=self.reward_fn
        )

    def annotate(self, groups, batch: TrainBatch | None) -> list:
        """The step's trajectories with the viewer's keys (``agent_r1.report.annotate``)."""
        advantage_of = None
        if batch is not None and batch.tokens.advantages is not None:
            means = batch.step_means(batch.tokens.advantages)
            advantage_of = {id(s): v for s, v in zip(batch.rows.steps, means, strict=True)}
        return annotate(groups, self.tokenizer, trajectory_success, advantage_of)

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, step: int, rng: dict | None = None) -> Path:
        """Checkpoint ``step`` (``rng``: the RNG state to record, default the current one)."""
        assert self.run_dir is not None
        trainer_state = {"rng": rng or rng_state(), "policy_version": self.policy_version}
        if self._in_flight is not None:
            # Async: the next step's rollout is finished and saved with the checkpoint, so a resumed
            # run trains exactly those samples — none lost, none sampled twice.
            trainer_state["in_flight"] = {"step": self._in_flight.step, "groups": self._collect_in_flight()}
        path = Path(self.learner.save_checkpoint(self.run_dir.checkpoints, step, trainer_state))
        self._saved_step = step
        return path

    def _preempted(self, step: int, rng: dict) -> None:
        """A preemption signal arrived: checkpoint ``step`` (the last one finished, with the RNG state
        it ended with) unless it is already saved, then raise ``Preempted``
        (``agent_r1.train.preemption``)."""
        checkpoint = None
        if step > 0:
            if self._saved_step != step:
                self.save_checkpoint(step, rng)
            checkpoint = self.run_dir.checkpoints / f"step_{step:06d}"
        self.preemption.done()
        logger.warning(
            "preempted: checkpoint of step %s written %.1f s after the signal",
            step,
            self.preemption.elapsed(),
        )
        raise Preempted(self.preemption.signum, step, checkpoint)

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


def train(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """``Trainer(config, **objects).fit()``: train and return the final metrics."""
    return Trainer(config, **objects).fit()
