"""Several policies in one run (docs/multi_agent.md): roles as data that the learning phases loop over.

A *role* is who acts in an episode (``Observation.role``: a planner, a seat of a game); a *policy* is
what plays it and trains from it (``policies:`` in the config, ``roles:`` maps roles to policies, a
role not listed is played by the policy of its own name). Each trained policy is a LoRA adapter of its
name on the one shared base model (``load_policy(..., adapters=trained_policies(config))``), with
its own optimizer and schedule, fresh or started from a saved adapter (``policies.<name>.adapter``,
``load_saved_adapters``). A frozen policy has no optimizer and is never sent by a weight sync: the
base model with every adapter off; or a saved adapter, loaded onto the shared base under its name
(not trainable; checkpoints hold it like any adapter); or an OpenAI-compatible server
(``policies.<name>.server``) that samples its roles instead of the local engine (``server_engines``,
``agent_r1.rollout.router.RoleRouter``).

A policy may instead have a model of its own (``policies.<name>.path``,
``agent_r1.train.builders.load_own_models``): trained,
a LoRA adapter of its name on that model with its own optimizer; frozen, the model as it is. It shares
the run's tokenizer (``check_own_models``), and an HF engine of its own samples its roles
(``agent_r1.train.builders.own_engines``, through ``RoleRouter``), sharing its model as the local engine shares the base;
checkpoints hold its adapter beside the others (``model/<name>/``).

- Sampling: the engine serves every role in one batch (``HFEngine`` / ``VLLMEngine`` ``roles=``, from
  ``engine_roles``): each request's ``SamplingParams.role`` picks its adapter; a server policy's
  roles go to its server. The HF engine shares the learner's model (``rollout.share_model``) or
  holds its own copy of it, every adapter included (``agent_r1.train.backends.engine_copy``;
  ``trainer.mode: async`` needs one); vLLM holds its own copy of each adapter (a frozen saved adapter loaded once from its folder). Each weight sync to an
  engine's own copy pushes the adapters of the policies that updated since the previous sync
  (``PolicyLearners.weights``: ``{adapter: LoraWeights}``, ``export_adapters``); the base and a
  frozen policy never change.
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

import asyncio
import contextlib
import json
import logging
import os
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agent_r1.rollout.base import LoraWeights
from agent_r1.train.config import ConfigError, TrainConfig
from agent_r1.types import TrajectoryGroup

__all__ = [
    "AdapterLearner",
    "PolicyLearners",
    "active_adapter",
    "adapter_folders",
    "adapter_of",
    "adapter_parameters",
    "adapter_policies",
    "by_policy",
    "check_adapters",
    "check_own_models",
    "check_server_tokenizer",
    "engine_roles",
    "export_adapters",
    "load_saved_adapters",
    "max_adapter_rank",
    "own_model_policies",
    "policy_model",
    "policy_of",
    "role_metrics",
    "roles_of",
    "server_engines",
    "trained_policies",
]

logger = logging.getLogger(__name__)


def trained_policies(config: TrainConfig) -> list[str]:
    """The policies that train (not frozen), in the config's order."""
    return [name for name, policy in config.policies.items() if not policy.frozen]


def adapter_policies(config: TrainConfig) -> list[str]:
    """The trained policies that are adapters on the shared base (no model of their own), in order."""
    return [name for name in trained_policies(config) if config.policies[name].path is None]


def own_model_policies(config: TrainConfig) -> list[str]:
    """The policies with a model of their own (``policies.<name>.path``), in the config's order."""
    return [name for name, policy in config.policies.items() if policy.path is not None]


def roles_of(config: TrainConfig, names: Sequence[str]) -> dict[str, str]:
    """role -> policy for the policies ``names``: each by its own name and every role mapped to it."""
    return {**{name: name for name in names}, **{r: p for r, p in config.roles.items() if p in names}}


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
    """What the local engine serves: role -> adapter name (None: the base model, adapters off), for
    every policy by its own name and every role in ``roles``, but the roles of a policy sampled by a
    server (``server_engines``) or with a model of its own (``agent_r1.train.builders.own_engines``); None
    with one policy."""
    if not config.policies:
        return None
    adapter = {
        name: None if policy.frozen and policy.adapter is None else name
        for name, policy in config.policies.items()
        if policy.server is None and policy.path is None
    }
    return {
        **adapter,
        **{role: adapter[policy] for role, policy in config.roles.items() if policy in adapter},
    }


def server_engines(config: TrainConfig, tokenizer) -> dict[str, Any]:
    """Each role of a policy sampled by a server (``policies.<name>.server``) -> an ``OpenAIEngine``
    on that server (one per policy), requests sent as ``policies.<name>.model`` (default: the
    server's first model). Lists the server's models once and checks that it shares ``tokenizer``
    (the run's: ``check_server_tokenizer``): a server that cannot be reached, a model it does not
    serve, another tokenizer or an API key not set is a ``ConfigError`` naming the key."""
    from agent_r1.rollout.openai_client import OpenAIEngine

    engines = {}
    for name, policy in config.policies.items():
        if policy.server is not None:
            api_key = _api_key(name, policy.api_key_env)
            model = _server_model(name, policy, api_key)
            check_server_tokenizer(name, policy.server, model, api_key, tokenizer)
            engines[name] = OpenAIEngine(policy.server, model, api_key=api_key)
    return {role: engines[policy] for role, policy in roles_of(config, list(engines)).items()}


def _api_key(name: str, variable: str | None) -> str | None:
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise ConfigError(f"policies.{name}.api_key_env", f"${variable} is not set or empty")
    return key


def _server_model(name: str, policy, api_key: str | None) -> str:
    from agent_r1.rollout.prompt_logprobs import PromptLogprobsError, served_models

    try:
        models = asyncio.run(served_models(policy.server, api_key=api_key))
    except PromptLogprobsError as error:
        raise ConfigError(f"policies.{name}.server", f"cannot list the server's models: {error}") from None
    if policy.model is not None and policy.model not in models:
        raise ConfigError(f"policies.{name}.model", f"{policy.server} serves {models}, not {policy.model!r}")
    return policy.model or models[0]


def check_server_tokenizer(name: str, server: str, model: str, api_key: str | None, tokenizer) -> None:
    """The server of policy ``name`` tokenizes a probe (a chat rendered by the run's template, with
    digits and non-ASCII text) into the ids ``tokenizer`` gives it: prompts go to the server as token
    ids, so another tokenizer would read them as other text. A ``ConfigError`` naming
    ``policies.<name>.server`` when they differ; a warning when the server has no ``/tokenize`` to
    ask (it must then share the tokenizer unchecked)."""
    from agent_r1.rollout.prompt_logprobs import PromptLogprobsError, served_tokens

    probe = "Probe: 12 + 30 = 42? Ünïcödé ✓ 日本語, tabs\tand  spaces."
    with contextlib.suppress(ValueError, TypeError):  # no chat template: the plain text alone
        probe = tokenizer.apply_chat_template(
            [{"role": "user", "content": probe}], tokenize=False, add_generation_prompt=True
        )
    key = f"policies.{name}.server"
    try:
        theirs = asyncio.run(served_tokens(server, probe, model=model, api_key=api_key))
    except PromptLogprobsError as error:
        raise ConfigError(key, f"cannot ask the server to tokenize a probe: {error}") from None
    if theirs is None:
        logger.warning(
            "%s: %s has no /tokenize endpoint, so whether it shares the run's tokenizer cannot be "
            "checked; prompts go to it as token ids, so it must (vllm serve and agent-r1 serve answer "
            "/tokenize)",
            key,
            server,
        )
        return
    ours = tokenizer.encode(probe, add_special_tokens=False)
    if theirs != ours:
        at = next(
            (i for i, (a, b) in enumerate(zip(theirs, ours, strict=False)) if a != b),
            min(len(theirs), len(ours)),
        )
        raise ConfigError(
            key,
            f"{server} (model {model!r}) tokenizes a probe differently from the run's tokenizer: "
            f"{len(theirs)} vs {len(ours)} tokens, first difference at token {at} ({theirs[at : at + 3]} vs "
            f"{ours[at : at + 3]}); prompts go to it as token ids, so it must share the run's tokenizer",
        )


def check_adapters(config: TrainConfig) -> None:
    """Each ``policies.<name>.adapter`` is a folder that peft saved a LoRA adapter in (its config and
    weights); a ``ConfigError`` naming the key otherwise. Whether it fits the base model is known only
    when it is loaded (``load_saved_adapters``)."""
    from agent_r1.models.loading import adapter_folder_problem

    for name, policy in config.policies.items():
        if policy.adapter is not None:
            problem = adapter_folder_problem(Path(policy.adapter))
            if problem is not None:
                raise ConfigError(f"policies.{name}.adapter", problem)


def what_loads(config: TrainConfig) -> list[str]:
    """What the run's policies load, one line each, as ``agent-r1 check`` prints it: the base, the
    saved adapter the policy starts from (``model.adapter``) or a fresh one, and with several
    policies each policy's own. Reads adapter configs only, no weights."""
    from agent_r1.models.loading import describe_lora, model_folder

    def saved(folder: str) -> str:
        return describe_lora(json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8")))

    lora = config.model.lora
    fresh = f"a fresh LoRA adapter of rank {lora.rank}, alpha {lora.alpha:g}" if lora.rank > 0 else None
    start = None
    if config.model.adapter:
        start = f"starts from the saved adapter {config.model.adapter!r} ({saved(config.model.adapter)})"
    lines = [f"model.path {config.model.path!r}: the base model"]
    if not config.policies:
        lines.append(f"policy: {start or fresh or 'every weight trained (model.lora.rank: 0)'}")
        return lines
    for name, policy in config.policies.items():
        if policy.server is not None:
            what = f"sampled by the server {policy.server}"
        elif policy.path is not None:
            folder = model_folder(policy.path, f"policies.{name}.path")
            what = f"a model of its own, {folder.describe()}"
            what += "" if policy.frozen else f"; trained: {'that adapter' if folder.adapter else fresh}"
        elif policy.adapter is not None:
            what = f"{'the' if policy.frozen else 'starts from the'} saved adapter {policy.adapter!r} ({saved(policy.adapter)})"
        elif policy.frozen:
            what = "the base model, every adapter off"
        else:
            what = start or fresh
        lines.append(f"policies.{name} ({'frozen' if policy.frozen else 'trained'}): {what}")
    return lines


def policy_model(config: TrainConfig):
    """The policy model of ``config`` on the CPU: ``load_policy`` with an adapter per trained policy
    on the shared base, and the saved adapters of ``policies.<name>.adapter`` loaded
    (``load_saved_adapters``). The policies with a model of their own:
    ``agent_r1.train.builders.load_own_models``."""
    from agent_r1.train.learner import load_policy

    model = load_policy(config.model, adapters=adapter_policies(config))
    if config.policies:
        load_saved_adapters(model, config)
    return model


def load_saved_adapters(model, config: TrainConfig) -> None:
    """Load each ``policies.<name>.adapter`` onto ``model`` (``load_policy``'s, holding a fresh
    adapter per trained policy) under the policy's name: a frozen policy's not trainable, a trained
    policy's in place of its fresh adapter. The first trained policy on the shared base stays active.
    An adapter that does not fit the base model (another architecture or size, modules it lacks) is
    a ``ConfigError`` naming ``policies.<name>.adapter``."""
    check_adapters(config)
    for name, policy in config.policies.items():
        if policy.adapter is None:
            continue
        if not policy.frozen:
            with warnings.catch_warnings():  # peft's note that another adapter is active now
                warnings.filterwarnings("ignore", "Adapter .* was active which is now deleted", UserWarning)
                model.delete_adapter(name)  # the fresh one load_policy added
        try:
            loaded = model.load_adapter(
                policy.adapter, adapter_name=name, is_trainable=not policy.frozen, torch_device="cpu"
            )
        except (ValueError, RuntimeError) as error:
            raise ConfigError(
                f"policies.{name}.adapter",
                f"{policy.adapter!r} does not fit the base model {config.model.path!r} (a LoRA adapter of "
                f"another model?): {' '.join(str(error).split())[:500]}",
            ) from None
        if loaded.missing_keys:
            raise ConfigError(
                f"policies.{name}.adapter",
                f"{policy.adapter!r} holds no weights for {len(loaded.missing_keys)} of the modules its "
                f"adapter_config.json targets, e.g. {loaded.missing_keys[:2]}",
            )
    model.set_adapter(adapter_policies(config)[0])
    model.eval()


def check_own_models(config: TrainConfig, tokenizer) -> None:
    """Each ``policies.<name>.path`` is a model folder whose tokenizer is the run's (the same
    vocabulary and chat template: an episode's prompts are tokenized once, for every role); a
    ``ConfigError`` naming the key otherwise. Reads tokenizer files only, no weights."""
    from agent_r1.models.loading import ModelNotFoundError, load_tokenizer, model_folder

    for name in own_model_policies(config):
        key, path = f"policies.{name}.path", config.policies[name].path
        if not Path(path).is_dir():
            raise ConfigError(
                key,
                f"{path!r} is not a folder (a relative path is taken from the working directory, "
                f"{Path.cwd()}, else from the config file's folder)",
            )
        try:
            folder = model_folder(path, key)  # a saved adapter: its own tokenizer, else its base's
            own = load_tokenizer(folder.tokenizer, require_template=False)
        except (ModelNotFoundError, OSError, ValueError) as error:
            raise ConfigError(key, f"{path!r}: its tokenizer cannot be loaded: {error}") from None
        if own.get_vocab() != tokenizer.get_vocab():
            raise ConfigError(
                key,
                f"{path!r} has another vocabulary than the run's tokenizer ({len(own)} vs {len(tokenizer)} "
                "tokens): every role's prompts are tokenized once, so a model of its own must share it",
            )
        if own.chat_template is not None and own.chat_template != tokenizer.chat_template:
            raise ConfigError(
                key,
                f"{path!r} has another chat template than the run's tokenizer: the episode is rendered "
                "once, for every role, so a model of its own must share it",
            )


def adapter_folders(config: TrainConfig) -> dict[str, str]:
    """The frozen policies' saved adapters (``policies.<name>.adapter``), by name: what an engine holding
    its own adapters loads once (vLLM); the learner never sends them (``PolicyLearners.weights``)."""
    return {
        name: policy.adapter
        for name, policy in config.policies.items()
        if policy.frozen and policy.adapter is not None
    }


def max_adapter_rank(config: TrainConfig) -> int:
    """The largest LoRA rank the engine serves: ``model.lora.rank``, or a saved adapter's
    (``model.adapter``, ``policies.<name>.adapter``)."""
    ranks = [config.model.lora.rank]
    saved = [p.adapter for p in config.policies.values() if p.adapter is not None]
    for folder in [config.model.adapter] * (config.model.adapter is not None) + saved:
        ranks.append(int(json.loads((Path(folder) / "adapter_config.json").read_text(encoding="utf-8"))["r"]))
    return max(ranks)


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

    def __init__(self, learners: Mapping[str, Any], model=None) -> None:
        self.learners = dict(learners)
        first = next(iter(self.learners.values()))
        self.model = first.model if model is None else model  # the shared base
        self.sync = first.sync
        self.updated: set[str] = set(self.learners)  # what an engine's own copy has not taken yet

    @property
    def own_models(self) -> dict[str, Any]:
        """The trained policies' models of their own (not the shared base), by name: what a
        checkpoint saves beside it (``model/<name>/``) and loads back."""
        return {
            name: learner.model for name, learner in self.learners.items() if learner.model is not self.model
        }

    def of(self, name: str) -> AdapterLearner:
        return AdapterLearner(self.learners[name], name, self.updated)

    def weights(self) -> Callable[[], dict[str, LoraWeights]]:
        """For an engine's own copy of the adapters (``agent_r1.train.backends.engine_copy``, vLLM): a
        function returning ``{adapter: LoraWeights}`` of every adapter in ``updated`` (then emptied),
        called when the engine takes them. A fresh learner counts every adapter as updated, so an
        engine that holds none yet (vLLM) gets them all first."""

        def changed() -> dict[str, LoraWeights]:
            own = self.own_models  # built once, not once per name
            names = [name for name in self.learners if name in self.updated and name not in own]
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
