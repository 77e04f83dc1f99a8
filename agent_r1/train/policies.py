"""Several policies in one run (docs/multi_agent.md): roles as data that the learning phases loop over.

A *role* is who acts in an episode (``Observation.role``: a planner, a seat of a game); a *policy* is
what plays it and trains from it (``policies:`` in the config, ``roles:`` maps roles to policies, a
role not listed is played by the policy of its own name). Each trained policy is a LoRA adapter of its
name on the one shared base model (``load_policy(..., adapters=trained_policies(config))``), with
its own optimizer and schedule; a frozen policy is the base
model with every adapter off.

- Sampling: the engine serves every role in one batch (``HFEngine`` / ``VLLMEngine`` ``roles=``, from
  ``engine_roles``): each request's ``SamplingParams.role`` picks its adapter. The HF engine shares
  the learner's model (``rollout.share_model``) or holds its own copy of it, every adapter included
  (``agent_r1.train.backends.engine_copy``; ``trainer.mode: async`` needs one); vLLM holds its own
  copy of each adapter. Each weight sync to an engine's own copy pushes the adapters of the policies
  that updated since the previous sync (``PolicyLearners.weights``: ``{adapter: LoraWeights}``,
  ``export_adapters``); the base and a frozen policy never change.
- Credit: groups are (task, role) (``agent_r1.flows.base.split_roles``), so each role's baseline
  compares it with its own samples.
- Learning: the kept groups are split by the policy that plays their role (``by_policy``); each
  trained policy's groups make its own batch, and the learning phases run on it with that policy's
  learner (``LocalLearner.for_policy``: its adapter active, its optimizer), so that every policy
  updates from its own steps in the same train step. Frozen policies' groups are not trained.
- Metrics: the rollout's means per role (``role/<role>/...``) and each policy's learning phases'
  metrics (``policy/<name>/...``).

Without ``policies`` there is one policy: every group trains it, and the metrics are today's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from agent_r1.rollout.base import LoraWeights
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.types import TrajectoryGroup

__all__ = [
    "AdapterLearner",
    "PolicyLearners",
    "adapter_of",
    "adapter_parameters",
    "by_policy",
    "engine_roles",
    "export_adapters",
    "policy_of",
    "role_metrics",
    "trained_policies",
]


def trained_policies(config: TrainConfig) -> list[str]:
    """The policies that train (not frozen), in the config's order."""
    return [name for name, policy in config.policies.items() if not policy.frozen]


def policy_of(config: TrainConfig, role: str | None) -> str | None:
    """The policy that plays ``role``: ``roles[role]``, else the policy of that name; None when the
    run has one policy. Raises ``ConfigError`` for a role that no policy plays."""
    if not config.policies:
        return None
    if role is None:
        raise ConfigError(
            "policies",
            f"an episode named no role (Observation.role unset), but several policies are configured "
            f"({sorted(config.policies)}): the env must name the role acting on each observation",
        )
    name = config.roles.get(role, role)
    if name not in config.policies:
        raise ConfigError(
            "roles",
            f"role {role!r} acted, but no policy plays it: add it to roles (role -> policy) or name a "
            f"policy after it; policies: {sorted(config.policies)}, roles: {dict(config.roles)}",
        )
    return name


def engine_roles(config: TrainConfig) -> dict[str, str | None] | None:
    """What the engine serves: role -> adapter name (None: the base model, adapters off), for every
    policy by its own name and every role in ``roles``; None with one policy."""
    if not config.policies:
        return None
    adapter = {name: None if policy.frozen else name for name, policy in config.policies.items()}
    return {**adapter, **{role: adapter[policy] for role, policy in config.roles.items()}}


def adapter_of(key: str) -> str | None:
    """The adapter a peft parameter name belongs to (``...lora_A.<adapter>.weight``), or None."""
    parts = key.split(".")
    return next((parts[i + 1] for i, part in enumerate(parts[:-1]) if part.startswith("lora_")), None)


def export_adapters(model, adapters: Sequence[str]) -> dict[str, LoraWeights]:
    """Each of ``adapters`` as peft's ``save_pretrained`` would write it, in memory (``LoraWeights``):
    what an engine holding its own copy of the adapters loads (``VLLMEngine.update_adapters``)."""
    from peft.utils import get_peft_model_state_dict

    out = {}
    for adapter in adapters:
        # adapter_config.json, as peft writes it (sets as lists)
        config = {
            k: sorted(v) if isinstance(v, set) else v for k, v in model.peft_config[adapter].to_dict().items()
        }
        tensors = get_peft_model_state_dict(model, adapter_name=adapter)
        out[adapter] = LoraWeights(config, {name: t.detach() for name, t in tensors.items()})
    return out


def adapter_parameters(model, adapter: str) -> list[torch.nn.Parameter]:
    """The parameters of ``adapter`` (peft names them ``...lora_A.<adapter>.weight``)."""
    params = [p for name, p in model.named_parameters() if adapter_of(name) == adapter]
    if not params:
        raise ValueError(f"the model has no LoRA adapter named {adapter!r}")
    return params


@contextlib.contextmanager
def active_adapter(model, adapter: str) -> Iterator[None]:
    """``adapter`` active (and alone trainable) inside; the previously active one restored after."""
    before = model.active_adapter
    model.set_adapter(adapter)
    try:
        yield
    finally:
        model.set_adapter(before)


class AdapterLearner:
    """A policy's ``Learner`` with its adapter active around each of its calls; each update adds
    the adapter's name to ``updated`` (what the next weight sync pushes)."""

    def __init__(self, learner, adapter: str, updated: set[str] | None = None) -> None:
        self.learner, self.adapter = learner, adapter
        self.updated = set() if updated is None else updated

    def __getattr__(self, name: str) -> Any:
        return getattr(self.learner, name)

    def logprobs(self, micro_batches, num_tokens: int, *, reference: bool = False):
        with active_adapter(self.learner.model, self.adapter):
            return self.learner.logprobs(micro_batches, num_tokens, reference=reference)

    def update(self, mini_batch, token_loss, *, with_entropy: bool = False) -> dict[str, float]:
        self.updated.add(self.adapter)
        with active_adapter(self.learner.model, self.adapter):
            return self.learner.update(mini_batch, token_loss, with_entropy=with_entropy)


class PolicyLearners:
    """Every trained policy's ``Learner`` over one shared model: what a checkpoint saves and loads
    (``state_dict``: each policy's optimizer and schedule by name). ``of(name)`` is one policy's.
    ``updated``: the policies whose adapter changed (an update, a loaded checkpoint) since the
    engine's copy last took them (``weights``)."""

    def __init__(self, learners: Mapping[str, Any]) -> None:
        self.learners = dict(learners)
        first = next(iter(self.learners.values()))
        self.model, self.sync = first.model, first.sync
        self.updated: set[str] = set(self.learners)  # what an engine's own copy has not taken yet

    def of(self, name: str) -> AdapterLearner:
        return AdapterLearner(self.learners[name], name, self.updated)

    def weights(self) -> Callable[[], dict[str, LoraWeights]]:
        """For an engine's own copy of the adapters (``agent_r1.train.backends.engine_copy``, vLLM): a
        function returning ``{adapter: LoraWeights}`` of every adapter in ``updated`` (then emptied),
        called when the engine takes them. A fresh learner counts every adapter as updated, so an
        engine that holds none yet (vLLM) gets them all first."""

        def changed() -> dict[str, LoraWeights]:
            names = [name for name in self.learners if name in self.updated]
            self.updated.clear()
            return export_adapters(self.model, names)

        return changed

    def state_dict(self) -> dict:
        return {"policies": {name: learner.state_dict() for name, learner in self.learners.items()}}

    def load_state_dict(self, state: Mapping) -> None:
        saved = state.get("policies", {})
        if set(saved) != set(self.learners):
            raise ValueError(
                f"the checkpoint holds the policies {sorted(saved)}, this run trains {sorted(self.learners)}"
            )
        for name, learner in self.learners.items():
            learner.load_state_dict(saved[name])
        self.updated.update(self.learners)  # loaded with a checkpoint's weights

    def logprobs(self, *args, **kwargs):
        raise TypeError("several policies: call PolicyLearners.of(name).logprobs")

    update = logprobs


def by_policy(config: TrainConfig, groups: Sequence[TrajectoryGroup]) -> list[tuple[str | None, list]]:
    """The kept groups of each trained policy (in the config's order), by the policy that plays each
    group's role; ``[(None, groups)]`` with one policy. Frozen policies' groups are left out, and a
    policy with no group (or no group at all) has no entry: nothing to learn."""
    if not config.policies:
        return [(None, list(groups))] if groups else []
    split: dict[str, list[TrajectoryGroup]] = {name: [] for name in trained_policies(config)}
    for group in groups:
        name = policy_of(config, group.role)
        if name in split:
            split[name].append(group)
    return [(name, kept) for name, kept in split.items() if kept]


def prefixed(metrics: Mapping[str, float], policy: str | None) -> dict[str, float]:
    """A policy's learning metrics under ``policy/<name>/``; unchanged with one policy."""
    if policy is None:
        return dict(metrics)
    return {f"policy/{policy}/{name}": value for name, value in metrics.items()}


def role_metrics(groups: Sequence[TrajectoryGroup], policy_version: int) -> dict[str, float]:
    """The rollout's means per role (reward, success, tokens...: ``summarize_rollout``) under
    ``role/<role>/``; nothing when no group has a role."""
    from agent_r1.train.summary import summarize_rollout

    roles = list(dict.fromkeys(g.role for g in groups if g.role is not None))
    out: dict[str, float] = {}
    for role in roles:
        summary = summarize_rollout([g for g in groups if g.role == role], policy_version)
        out.update({f"role/{role}/{name}": value for name, value in summary.metrics.items()})
    return out
