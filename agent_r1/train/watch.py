"""Held-out success, watched: a run that stops learning says why, and keeps its best policy.

``HeldOutWatch`` reads every training step's metrics and every evaluation's. At each evaluation:

- **Best.** A held-out success above every earlier evaluation's (the start's included; a tie goes to the
  earlier one, then ``eval/reward`` decides) makes this step the best: the trainer keeps its
  checkpoint as ``checkpoints/best`` (``agent_r1.train.checkpoint.keep_best``), which ``agent-r1 eval
  --checkpoint`` and ``agent-r1 train --resume-from`` take like any checkpoint. The start itself is
  ``model.path``: no ``best`` is written until an evaluation beats it.
- **Below the start.** When success falls below the start's by more than the evaluation's noise, the
  log says so once (and again only when the causes it names change), with the likely causes read
  from the training metrics since the best evaluation, against those before it (``SIGNALS``): the
  training reward falling too (updates too large), the policy's entropy collapsing, grad-norm spikes, the sampler's log-probs drifting from the learner's,
  groups whose rewards all agree (no learning signal), responses or episodes cut at their limits, the
  training reward rising while held-out success falls (what is rewarded is not what is measured).
  None of them moving is said too.

The noise: the two success rates are means over n evaluated trajectories each (``eval/trajectories``),
so their difference has the standard error sqrt(2 p (1 - p) / n) at the pooled rate p (two-proportion
z-test), the spread the same policy shows on another n tasks or another seed. A drop of more than
``NOISE_Z`` = 2 standard errors is reported. The deviation: seeds also change the training path,
which one run cannot measure; the report at that noise is what one run can say.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["NOISE_Z", "SIGNALS", "HeldOutWatch", "Signal", "drop_noise"]

logger = logging.getLogger(__name__)

NOISE_Z = 2.0
"""Standard errors a drop below the start must exceed to be reported."""


def drop_noise(start: float, now: float, n: int) -> float:
    """``NOISE_Z`` standard errors of the difference of two success rates over ``n`` trajectories each
    (pooled two-proportion test); 0 when both rates are 0 or both 1 (no spread to measure)."""
    pooled = (start + now) / 2
    return NOISE_Z * math.sqrt(2 * pooled * (1 - pooled) / max(n, 1))


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def _median(values: Sequence[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _entropy_collapse(before: Sequence[float], since: Sequence[float]) -> str | None:
    start, now = before[0], _mean(since)
    if now < 0.5 * start:
        return (
            f"the policy's entropy fell from {start:.3g} to {now:.3g} nats a token: it samples few "
            "distinct answers, so groups stop disagreeing (raise rollout.temperature or "
            "algorithm.entropy_coef, or lower trainer.lr)"
        )
    return None


def _grad_norm_spikes(before: Sequence[float], since: Sequence[float]) -> str | None:
    updated = [v for v in before if v > 0]  # a step whose every loss vanished has no gradient at all
    if not updated:
        return None
    usual, peak = _median(updated), max(since)
    if peak > 3 * usual:
        return (
            f"the gradient norm reached {peak:.3g}, {peak / usual:.1f}x its median {usual:.3g} before: "
            "large updates (lower trainer.lr or trainer.max_grad_norm)"
        )
    return None


def _mismatch(before: Sequence[float], since: Sequence[float]) -> str | None:
    now = _mean(since)
    if now > 0.01 and now > 2 * _mean(before):
        return (
            f"the sampler's log-probs drifted from the learner's: KL {now:.3g} nats a token since, "
            f"{_mean(before):.3g} before (an off-policy correction drops or weights the worst tokens: "
            "algorithm.off_policy)"
        )
    return None


def _zero_variance(before: Sequence[float], since: Sequence[float]) -> str | None:
    now = _mean(since)
    if now > 0.5 and now > _mean(before) + 0.2:
        return (
            f"{now:.0%} of the groups had rewards that all agree (no learning signal), {_mean(before):.0%} "
            "before (harder tasks, a larger rollout.n, or algorithm.dynamic_filter)"
        )
    return None


def _cut_off(what: str, key: str) -> Callable[[Sequence[float], Sequence[float]], str | None]:
    def rule(before: Sequence[float], since: Sequence[float]) -> str | None:
        now = _mean(since)
        if now > 0.1 and now > _mean(before) + 0.1:
            return f"{now:.0%} of the trajectories {what}, {_mean(before):.0%} before ({key})"
        return None

    return rule


def _reward_fell(before: Sequence[float], since: Sequence[float]) -> str | None:
    then, now = _mean(before), _mean(since)
    if now < then - max(0.05, 0.1 * abs(then)):
        return (
            f"the training reward fell too ({then:.3g} to {now:.3g}, lowest {min(since):.3g}): the updates made "
            "the policy worse on the very tasks it trains on, steps too large for it (lower trainer.lr: "
            "Adam moves every weight by about lr at its first steps, whatever the gradient's size; or "
            "raise trainer.warmup_steps)"
        )
    return None


def _reward_rose(before: Sequence[float], since: Sequence[float]) -> str | None:
    then, now = _mean(before), _mean(since)
    if now > then + max(0.05, 0.1 * abs(then)):
        return (
            f"the training reward rose ({then:.3g} to {now:.3g}) while held-out success fell: the policy "
            "learns what the training reward pays for, and the held-out tasks do not reward it (a reward "
            "function that differs from success, or a shortcut of the training tasks)"
        )
    return None


@dataclass(frozen=True)
class Signal:
    """One likely cause: the training metric it reads (a key, or a ``policy/<name>/`` key ending in
    it), and the rule that reads its values before the best evaluation and since, returning what it
    saw, or None."""

    name: str
    metric: str
    rule: Callable[[Sequence[float], Sequence[float]], str | None]


SIGNALS = (
    Signal("training_reward_fell", "reward/mean", _reward_fell),
    Signal("entropy_collapse", "entropy/mean", _entropy_collapse),
    Signal("grad_norm_spikes", "grad_norm", _grad_norm_spikes),
    Signal("mismatch", "off_policy/kl_k3", _mismatch),
    Signal("zero_variance_groups", "filter/zero_variance_fraction", _zero_variance),
    Signal(
        "truncation",
        "rollout/truncated_fraction",
        _cut_off(
            "were cut short (TRUNCATED: a prompt outgrew rollout.max_prompt_tokens or the model's context)",
            "a context policy that keeps prompts short, e.g. the env's context: sliding_window",
        ),
    ),
    Signal(
        "step_limit",
        "rollout/step_limit_fraction",
        _cut_off("ran out of steps", "rollout.max_steps, the env's max_turns"),
    ),
    Signal("training_reward_rose", "reward/mean", _reward_rose),
)
"""What a drop below the start is checked against, in the order they are named."""


def _values(metrics: Mapping[str, float], key: str) -> list[float]:
    """The step's values of ``key``: the key itself, or every policy's (``policy/<name>/<key>``)."""
    return [
        float(v)
        for k, v in metrics.items()
        if (k == key or (k.startswith("policy/") and k.endswith("/" + key))) and math.isfinite(v)
    ]


@dataclass
class HeldOutWatch:
    """The state of the watch (module docstring): the start's and the best evaluation's success and
    reward, and each signal's values by step, so that a resumed run watches on as if uninterrupted
    (``state_dict``)."""

    start: tuple[float, float] | None = None  # (success, reward) of the first evaluation
    best: tuple[float, float] | None = None
    best_step: int = 0
    reported: tuple[str, ...] | None = None  # the causes last reported, None: not below the start
    history: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    def observe_step(self, step: int, metrics: Mapping[str, float]) -> None:
        """A training step's metrics: the values the signals read."""
        derived = dict(metrics)
        groups = metrics.get("filter/groups")
        if groups:
            derived["filter/zero_variance_fraction"] = (
                metrics.get("filter/zero_variance_groups", 0.0) / groups
            )
        for signal in SIGNALS:
            values = _values(derived, signal.metric)
            if values:
                self.history.setdefault(signal.name, []).append((step, max(values)))

    def observe_eval(self, step: int, metrics: Mapping[str, float]) -> tuple[bool, dict[str, float]]:
        """An evaluation's metrics: whether ``step`` is the new best (the start never is), and the
        watch's metrics for the log (``watch/best_success``, ``watch/best_step``, ``watch/below_start``
        and, when below, ``watch/cause/<signal>`` for each likely cause)."""
        if "eval/success" not in metrics:
            return False, {}
        now = (float(metrics["eval/success"]), float(metrics.get("eval/reward", 0.0)))
        is_best = False
        if self.start is None:
            self.start = self.best = now
            self.best_step = step
        elif now > self.best:
            self.best, self.best_step, is_best = now, step, True
        noise = drop_noise(self.start[0], now[0], int(metrics.get("eval/trajectories", 1)))
        below = self.start[0] - now[0] > noise
        out = {
            "watch/best_success": self.best[0],
            "watch/best_step": float(self.best_step),
            "watch/below_start": float(below),
        }
        if not below:
            self.reported = None
            return is_best, out
        causes = self.causes()
        out.update({f"watch/cause/{name}": 1.0 for name, _ in causes})
        if tuple(name for name, _ in causes) != self.reported:
            self.reported = tuple(name for name, _ in causes)
            logger.warning(self.explain(step, now[0], noise, causes))
        return is_best, out

    def causes(self) -> list[tuple[str, str]]:
        """(signal, what it saw) for each signal that moved since the best evaluation against the steps
        up to it (when the start was the best: since the first step, against it); a signal needs
        values on both sides."""
        found = []
        for signal in SIGNALS:
            values = self.history.get(signal.name, [])
            before = [v for s, v in values if s <= self.best_step]
            since = [v for s, v in values if s > self.best_step]
            if not before:  # the start was the best: the first step is the baseline
                before, since = since[:1], since[1:]
            said = signal.rule(before, since) if before and since else None
            if said is not None:
                found.append((signal.name, said))
        return found

    def explain(self, step: int, success: float, noise: float, causes: list[tuple[str, str]]) -> str:
        assert self.start is not None and self.best is not None
        head = (
            f"held-out success fell below the start: {success:.3f} at step {step} against {self.start[0]:.3f} "
            f"at the start, more than the evaluation's noise ({NOISE_Z:g} standard errors = {noise:.3f}); "
            f"the best was {self.best[0]:.3f} at step {self.best_step}"
            + (" (checkpoints/best)" if self.best_step else "")
            + "."
        )
        if not causes:
            watched = ", ".join(signal.name for signal in SIGNALS)
            return (
                f"{head} None of the watched signals moved since step {self.best_step} ({watched}): "
                "compare the trajectories of the two evaluations in the report (agent-r1 report RUN_DIR)"
            )
        listed = "; ".join(f"{name}: {said}" for name, said in causes)
        return f"{head} Likely cause, from this run's metrics since step {self.best_step}: {listed}"

    def state_dict(self) -> dict:
        return {
            "start": self.start,
            "best": self.best,
            "best_step": self.best_step,
            "reported": self.reported,
            "history": {k: list(v) for k, v in self.history.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.start = tuple(state["start"]) if state.get("start") is not None else None
        self.best = tuple(state["best"]) if state.get("best") is not None else None
        self.best_step = int(state.get("best_step", 0))
        self.reported = tuple(state["reported"]) if state.get("reported") is not None else None
        self.history = {k: [tuple(x) for x in v] for k, v in state.get("history", {}).items()}
