"""The RL trainer: one step is a sequence of named, timed phases, top to bottom.

    sample tasks -> rollout -> score -> filter -> batch -> old log-probs -> reference -> values
    -> advantages -> teacher -> update -> sync weights -> log / eval / checkpoint

With several policies (``policies:``, ``agent_r1.train.policies``) the steps from batch to update run
once per trained policy, on the groups of the roles it plays.

The phases after the batch are units ``(batch, context) -> (batch, metrics)`` that live with what
they serve (``agent_r1.train.phases.LEARNING_PHASES``); the trainer sequences and times them and
holds no algorithm code. Which rollout a step trains on and when the engine takes new weights (sync
or one step ahead) is ``agent_r1.train.schedule``.

The loop exists once and runs on two backends (``agent_r1.train.backends``): a rollout backend and a
learner backend, in this process or on Ray (``distributed.backend: ray``). The step's training data
is one ``agent_r1.train.batch.TrainBatch``, built once from the kept groups; each phase after it
returns its per-token result and the batch is enriched with it (``with_tokens``), never mutated.

Choices, and where they come from:

- **Rollout in-process**: the HF engine and the learner share ONE model object by default
  (``rollout.share_model``): weight sync is then a version bump, no copy, no second model in memory.
  ``share_model: false`` gives the engine its own copy, synced after each update by
  ``Engine.update_weights`` (LoRA weights are merged into that copy; with several policies the copy
  holds every adapter and takes those that changed, by name); so does ``rollout.engine: vllm``,
  which can also sleep during each update (one GPU). All use exactly the sampler's distribution,
  ``log softmax(logits / temperature)`` over the full vocabulary.
- **Old log-probs** (``agent_r1.train.phases``) for the PPO ratio: the learner's recomputation before the update (default, so that
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from agent_r1.flows.base import AgentFlow, split_roles
from agent_r1.report.annotate import annotate
from agent_r1.report.html import write_finished_report
from agent_r1.train.backends import BackendParts, backend_config, make_backends
from agent_r1.train.batch import TrainBatch, build_batch, keep_groups, prefix_pair_cost, step_advantages
from agent_r1.train.builders import (
    check_env,
    estimator_needs,
    load_config_tokenizer,
    policy_objective,
    value_objective,
)
from agent_r1.train.checkpoint import keep_best, rng_state, set_rng_state
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.train.data import TaskSampler, config_tasks
from agent_r1.train.evaluation import evaluate_rollouts
from agent_r1.train.health import ZeroVarianceWatch, error_budget
from agent_r1.train.learner import TokenLoss
from agent_r1.train.phases import LEARNING_PHASES
from agent_r1.train.policies import by_policy, prefixed, role_metrics
from agent_r1.train.preemption import Preempted, PreemptionGuard, StopSampling
from agent_r1.train.process import apply_process_settings
from agent_r1.train.progress import progress_bar
from agent_r1.train.resume import ResumeMode, resume_checkpoint
from agent_r1.train.role_baseline import RoleBaselines
from agent_r1.train.run_dir import RunDir
from agent_r1.train.schedule import Rollout, RolloutSchedule
from agent_r1.train.step_context import StepContext
from agent_r1.train.summary import (
    RewardFn,
    RolloutSummary,
    score_groups,
    summarize_rollout,
    trajectory_success,
)
from agent_r1.train.watch import HeldOutWatch
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
        parts = BackendParts(model, engine, flow, eval_flow, env_factory, runtime_env=runtime_env)
        # Checked before anything starts: Ray refuses objects built here, and reads absolute paths.
        config = backend_config(config, parts)
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
        self.baselines = RoleBaselines(config.algorithm.advantage.baseline_decay)  # rae's, checkpointed
        backends = make_backends(config, self.tokenizer, replace(parts, with_eval=self.val_tasks is not None))
        self.rollouts, self.learner = backends.rollouts, backends.learner
        self.model = backends.model  # the policy, when it lives in this process
        self.pair_cost = prefix_pair_cost(config, backends.model_config, backends.learner_device)
        self.step = 0
        self.run_dir: RunDir | None = None
        self.resume = resume
        self.zero_variance = ZeroVarianceWatch(group_baseline=estimator_needs(config).min_group_size > 1)
        self.watch = HeldOutWatch()  # held-out success: the best checkpoint, and why it fell
        self.preemption = PreemptionGuard(trainer.preemption_grace_s)  # installed by fit
        self.schedule = RolloutSchedule(config, self.rollouts, self.learner, self.preemption)
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
                    self.run_dir.log(0, self.evaluate_and_watch(0))
                ended_rng = rng_state()  # the RNG state where the last step ended (a checkpoint's)
                for step in range(start + 1, cfg.steps + 1):
                    self.step = step
                    try:
                        last = self.train_step(step)
                    except StopSampling:  # preempted mid-rollout: the state is the previous step's
                        self._preempted(step - 1, ended_rng)
                    self.run_dir.log(step, last)
                    self.watch.observe_step(step, last)
                    if (
                        cfg.eval_every
                        and self.val_tasks
                        and (step % cfg.eval_every == 0 or step == cfg.steps)
                    ):
                        eval_metrics = self.evaluate_and_watch(step)
                        self.run_dir.log(step, eval_metrics)
                        last = {**last, **eval_metrics}
                    due = (cfg.checkpoint_every and step % cfg.checkpoint_every == 0) or step == cfg.steps
                    if due and self._saved_step != step:  # a new best is saved already
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
            groups, kept, span, metrics = self.collect_groups(tasks, step, timer)
            batches = []
            learn_start = time.time()
            for policy, policy_groups in by_policy(self.config, kept):  # one policy: (None, kept)
                with timer("batch"):
                    batch = self.batch(policy_groups, step)
                context = self.context(step, policy)
                for name, phase in LEARNING_PHASES:
                    with timer(name):
                        batch, phase_metrics = phase(batch, context)
                    metrics.update(prefixed(phase_metrics, policy))
                batches.append(batch)
            if batches:
                with timer("sync"):
                    self.rollouts.wake()
                    self.schedule.new_version()
            else:
                metrics["update/skipped"] = 1.0
            metrics.update(_timeline(span, learn_start, time.time()))
            metrics.update(self.rollouts.metrics())
            metrics.update(self.learner.metrics())
        if self.config.logging.dump_trajectories and self.run_dir is not None:
            self.run_dir.dump_trajectories(step, self.annotate(groups, batches))
        metrics.update(timer.seconds)
        metrics["throughput/tokens_per_s"] = metrics["throughput/sampled_tokens"] / max(
            timer.seconds["time/step"], 1e-9
        )
        return metrics

    def collect_groups(self, tasks: Sequence[Task], step: int, timer: _Timer):
        """Phases 2-4 (rollout, score, filter), repeated for DAPO's resampling rounds; returns every
        group rolled out, the kept ones, when the rollouts ran (first start, last end) and the
        rollout's metrics, after the error budget's check."""
        rounds, extra, kept, groups, spans = 0, tasks, [], [], []
        while rounds == 0 or (len(kept) < len(tasks) and rounds <= self.config.algorithm.resample_rounds):
            if rounds:
                extra = self.sampler.extra(step, rounds, len(tasks) - len(kept))
            with timer("rollout"):
                rollout = self._rollout(extra, step, resample=rounds)
            with timer("score"):
                more = self.score(split_roles(rollout.groups), extra)  # groups are (task, role)
            with timer("filter"):
                more_kept, more_metrics = self.filter(more)
            if not rounds:
                filter_metrics = more_metrics
            groups += more
            kept += more_kept[: len(tasks) - len(kept)]
            spans.append((rollout.started, rollout.finished))
            rounds += 1
        if self.config.algorithm.resample_rounds:
            filter_metrics["filter/resample_rounds"] = float(rounds - 1)
            filter_metrics["filter/kept_groups"] = float(len(kept))
        summary = summarize_rollout(groups, self.schedule.policy_version)
        metrics = {**summary.metrics, **role_metrics(groups, self.schedule.policy_version), **filter_metrics}
        self.check_health(summary, groups, step)
        self.zero_variance.observe_step(step, metrics)  # filter/*: the first round's (task, role) groups
        return groups, kept, (spans[0][0], spans[-1][1]), metrics

    # ------------------------------------------------------------------ phases

    def rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> list[TrajectoryGroup]:
        """Phase 2: ``rollout.n`` samples of every task, all concurrently, seeded by (seed, step, and
        the DAPO resampling round if any); each step records the policy version that sampled it. In
        async mode the rollout submitted ahead (``agent_r1.train.schedule``)."""
        return self._rollout(tasks, step, resample=resample).groups

    def _rollout(self, tasks: Sequence[Task], step: int, *, resample: int = 0) -> Rollout:
        return self.schedule.rollout(
            tasks, step, resample=resample, next_tasks=lambda: self.sampler.batch(step + 1)
        )

    def score(self, groups: list[TrajectoryGroup], tasks: Sequence[Task]) -> list[TrajectoryGroup]:
        """Phase 3: the env already scored each trajectory; ``reward_fn`` (if given) replaces it."""
        return score_groups(groups, tasks, self.reward_fn)

    def filter(self, groups: list[TrajectoryGroup]) -> tuple[list[TrajectoryGroup], dict[str, float]]:
        """Phase 4: the groups that train (``agent_r1.train.batch.keep_groups``)."""
        return keep_groups(groups, dynamic_filter=self.config.algorithm.dynamic_filter)

    def batch(self, groups: list[TrajectoryGroup], step: int) -> TrainBatch:
        """Phase 5: the step's one batch (``agent_r1.train.batch``): token layout, step table,
        mini-batches, their token masks and packed micro-batches."""
        cfg = self.config.trainer
        return build_batch(
            groups,
            mini_batches=cfg.mini_batches,
            micro_batch_tokens=cfg.micro_batch_tokens,
            pair_cost=self.pair_cost,
            seed=cfg.seed,
            step=step,
        )

    def context(self, step: int, policy: str | None = None) -> StepContext:
        """What the learning phases 6-10 (``agent_r1.train.phases``) of ``step`` read besides the batch,
        for ``policy`` (``agent_r1.train.policies``; None: the run's one policy)."""
        learner = self.learner if policy is None else self.learner.for_policy(policy)
        objectives = (self.objective, self.value_objective, estimator_needs(self.config))
        return StepContext(self.config, learner, self.rollouts, step, *objectives, self.baselines)

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
            self.run_dir.dump_trajectories(step, self.annotate(groups, []))
        raise halt

    def evaluate(self) -> dict[str, float]:
        """``agent_r1.train.evaluation.evaluate_rollouts`` on the validation tasks, sampled with the
        newest weights only (a rollout in flight completes first; the step that trains on it takes
        its stored result)."""
        if not self.val_tasks:
            return {}
        self.schedule.newest_weights()
        return evaluate_rollouts(
            self.rollouts, self.val_tasks, self.config, self.step, reward_fn=self.reward_fn
        )

    def evaluate_and_watch(self, step: int) -> dict[str, float]:
        """``evaluate``, read by the held-out watch (``agent_r1.train.watch``): a drop below the start
        is logged with its likely cause, and a new best evaluation's checkpoint is kept as
        ``checkpoints/best``."""
        metrics = self.evaluate()
        is_best, watched = self.watch.observe_eval(step, metrics)
        if is_best:
            saved = self.run_dir.checkpoints / f"step_{step:06d}"
            keep_best(saved if self._saved_step == step else self.save_checkpoint(step))
        return {**metrics, **watched}

    def annotate(self, groups, batches: Sequence[TrainBatch]) -> list:
        """The step's trajectories with the viewer's keys (``agent_r1.report.annotate``), with the
        advantages of the batches trained (one per policy, ``step_advantages``)."""
        return annotate(groups, self.tokenizer, trajectory_success, step_advantages(batches))

    # ------------------------------------------------------------------ checkpoints

    @property
    def policy_version(self) -> int:
        return self.schedule.policy_version

    def save_checkpoint(self, step: int, rng: dict | None = None) -> Path:
        """Checkpoint ``step`` (``rng``: the RNG state to record, default the current one) with the
        rollout schedule's state (``RolloutSchedule.state``)."""
        assert self.run_dir is not None
        baselines = {"role_baselines": self.baselines.state_dict(), "watch": self.watch.state_dict()}
        trainer_state = {"rng": rng or rng_state(), **self.schedule.state(), **baselines}
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
        self.schedule.restore(trainer_state)
        self.baselines.load_state_dict(trainer_state.get("role_baselines", {}))
        self.watch.load_state_dict(trainer_state.get("watch", {}))
        self.step = trainer_state["step"]
        return self.step

    def close(self) -> None:
        """Release the backends (engines, Ray actors and workers, a local Ray cluster it started)."""
        try:
            self.rollouts.close()
        finally:
            self.learner.close()


def _timeline(span: tuple[float | None, float | None], learn_start: float, learn_end: float) -> dict:
    """When the step's rollout and its learning phases ran (``time.time()``, so that a resumed run
    continues the same clock): the report draws them as a timeline, so that the overlap of async mode
    is visible."""
    spans = {"rollout": span, "update": (learn_start, learn_end)}
    return {
        f"timeline/{phase}_{edge}": moment
        for phase, span in spans.items()
        if None not in span
        for edge, moment in zip(("start", "end"), span, strict=True)
    }


def train(config: TrainConfig, **objects: Any) -> dict[str, float]:
    """``Trainer(config, **objects).fit()``: train and return the final metrics."""
    return Trainer(config, **objects).fit()
