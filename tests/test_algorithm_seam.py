"""The algorithm seam: every option of every registered concept is reachable from a config file and
arrives unchanged in the function that uses it; estimators and losses registered outside the package
train by name; the trainer passes step ids (not trajectory ids) to sequence-level losses.

The ``recording_*`` entries below are test doubles: each wraps a real registered function (GRPO,
PPO-clip, k3, token-mean) and records what the trainer handed it.
"""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest
import torch
import yaml
from trainer_envs import tasks

from agent_r1.algos import (
    AdvantageConfig,
    AggregationConfig,
    KLConfig,
    OffPolicyConfig,
    PolicyLossConfig,
    TokenFields,
    get_advantage_estimator,
    get_kl_estimator,
    get_loss_aggregation,
    get_off_policy_correction,
    get_policy_loss,
    kl_penalty,
    register_advantage,
    register_aggregation,
    register_kl_estimator,
    register_off_policy_correction,
    register_policy_loss,
)
from agent_r1.train import phases
from agent_r1.train.builders import policy_objective
from agent_r1.train.config import ConfigError, load_config
from agent_r1.train.trainer import Trainer
from agent_r1.train.update import loss_weights

SEEN: dict[str, list] = {"advantage": [], "loss": [], "kl": [], "aggregation": [], "off_policy": []}


@register_advantage("recording_grpo", min_group_size=3)
def recording_grpo(table, cfg):
    SEEN["advantage"].append((cfg, table))
    return get_advantage_estimator("grpo")(table, cfg)


@register_policy_loss("recording_ppo_clip")
def recording_ppo_clip(logprobs, old_logprobs, advantages, mask, cfg, *, seq_ids=None):
    SEEN["loss"].append((cfg, seq_ids))
    return get_policy_loss("ppo_clip")(logprobs, old_logprobs, advantages, mask, cfg, seq_ids=seq_ids)


@register_policy_loss("recording_gspo")
def recording_gspo(logprobs, old_logprobs, advantages, mask, cfg, *, seq_ids=None):
    SEEN["loss"].append((cfg, seq_ids))
    return get_policy_loss("gspo")(logprobs, old_logprobs, advantages, mask, cfg, seq_ids=seq_ids)


@register_kl_estimator("recording_k3")
def recording_k3(log_ratio):
    kl = get_kl_estimator("k3")(log_ratio)
    SEEN["kl"].append(kl.detach())
    return kl


@register_aggregation("recording_token_mean")
def recording_token_mean(mask, counts, norm_len):
    SEEN["aggregation"].append((norm_len, counts, mask))
    return get_loss_aggregation("token-mean")(mask, counts, norm_len)


@register_off_policy_correction("recording_mis_step")
def recording_mis_step(log_rho, mask, cfg, **ids):
    SEEN["off_policy"].append((cfg, ids))
    return get_off_policy_correction("mis_step")(log_rho, mask, cfg, **ids)


# A value other than the default for every field of every options dataclass. A new field without an
# entry here fails ``test_every_option_has_a_round_trip_case``.
NON_DEFAULT = {
    AdvantageConfig: {
        "name": "rloo",
        "gamma": 0.9,
        "lam": 0.8,
        "norm_by_std": False,
        "eps": 1e-3,
        "step_weight": 0.5,
        "whiten": True,
        "baseline_decay": 0.5,
    },
    PolicyLossConfig: {
        "name": "gspo",
        "clip_low": 0.1,
        "clip_high": 0.3,
        "dual_clip": 3.0,
        "gspo_clip_low": 2e-4,  # written as 2e-4 in YAML, which PyYAML reads as a string
        "gspo_clip_high": 5e-4,
        "cispo_ratio_min": 0.5,
        "cispo_ratio_max": 2.0,
    },
    KLConfig: {"coef": 0.05, "estimator": "k1", "penalty": "reward"},
    AggregationConfig: {"name": "seq-mean-token-mean", "equal_trajectory_weight": True, "norm_len": 64.0},
    OffPolicyConfig: {
        "name": "icepop",
        "tis_cap": 3.0,
        "mis_low": 0.4,
        "mis_high": 3.0,
        "icepop_low": 0.2,
        "icepop_high": 4.0,
    },
}
SECTION = {
    AdvantageConfig: "advantage",
    PolicyLossConfig: "policy_loss",
    KLConfig: "kl",
    AggregationConfig: "loss_aggregation",
    OffPolicyConfig: "off_policy",
}


def test_every_option_has_a_round_trip_case():
    for cls, values in NON_DEFAULT.items():
        assert set(values) == {f.name for f in fields(cls)}, cls.__name__
        for name, value in values.items():
            assert getattr(cls(), name) != value, f"{cls.__name__}.{name}: pick a non-default value"


@pytest.mark.parametrize(
    ("cls", "name"), [(cls, name) for cls, values in NON_DEFAULT.items() for name in values]
)
def test_each_option_round_trips_from_a_config_file(tmp_path, cls, name):
    value = NON_DEFAULT[cls][name]
    text = yaml.safe_dump({"algorithm": {SECTION[cls]: {name: value}}}).replace("0.0002", "2e-4")
    path = tmp_path / "config.yaml"
    path.write_text(text)
    from_file = load_config(path)
    from_cli = load_config(None, [f"algorithm.{SECTION[cls]}.{name}={value}"])
    for config in (from_file, from_cli):
        section = getattr(config.algorithm, SECTION[cls])
        assert section == replace(cls(), **{name: value})


def test_the_objective_hands_the_policy_loss_and_kl_sections_to_the_functions_unchanged():
    options = {k: v for k, v in NON_DEFAULT[PolicyLossConfig].items() if k != "name"}
    config = load_config(
        None,
        [f"algorithm.policy_loss.{k}={v}" for k, v in options.items()]
        + ["algorithm.policy_loss.name=recording_ppo_clip", "algorithm.kl.coef=0.1"]
        + ["algorithm.kl.estimator=recording_k3"],
    )
    objective = policy_objective(config)
    SEEN["loss"].clear()
    SEEN["kl"].clear()
    n = 5
    tokens = TokenFields(
        mask=torch.ones(n),
        step_ids=torch.tensor([0, 0, 1, 1, 1]),
        traj_ids=torch.zeros(n, dtype=torch.long),
        sampler_logprobs=torch.full((n,), -1.0),
        ref_logprobs=torch.full((n,), -2.0),
        advantages=torch.linspace(-1, 1, n),
    )
    logprobs = torch.full((n,), -1.5, requires_grad=True)
    loss_K, _ = objective(logprobs, None, tokens)
    ((cfg, seq_ids),) = SEEN["loss"]
    assert cfg == config.algorithm.policy_loss and cfg.cispo_ratio_max == 2.0 and cfg.dual_clip == 3.0
    assert seq_ids.tolist() == [0, 0, 1, 1, 1]
    (kl_K,) = SEEN["kl"]  # the KL loss term, with the configured estimator and coefficient
    without_kl, _ = replace(objective, kl=KLConfig())(logprobs, None, tokens)
    torch.testing.assert_close(loss_K - without_kl, 0.1 * kl_K)


def test_moved_flat_keys_say_where_they_went():
    with pytest.raises(ConfigError, match="moved to 'algorithm.kl.coef'"):
        load_config(None, ["algorithm.kl_coef=0.1"])


def test_a_name_override_keeps_the_sections_other_options(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("algorithm:\n  policy_loss: {name: ppo_clip, dual_clip: 3.0}\n")
    config = load_config(path, ["algorithm.policy_loss=cispo"])
    assert config.algorithm.policy_loss == PolicyLossConfig(name="cispo", dual_clip=3.0)


def test_declared_needs_drive_the_config_checks():
    with pytest.raises(ConfigError, match=r"rollout.n.*'recording_grpo' baseline needs n >= 3"):
        load_config(None, ["algorithm.advantage=recording_grpo", "rollout.n=2"])
    with pytest.raises(ConfigError, match="'reinforce' is correct only on-policy"):
        load_config(None, ["algorithm.policy_loss=reinforce", "trainer.mini_batches=2"])


def test_custom_estimator_loss_kl_and_aggregation_train_by_name_with_every_option(tiny_checkpoint, tmp_path):
    """Registered in this file, not the package, and selected by name only; every option reaches its
    function: the estimator sees its section and the KL reward penalty, the loss its section and step
    ids, the aggregation norm_len and per-trajectory scopes."""
    config = load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            "env.name=trainer_envs:LowByteEnv",
            "rollout.n=3",
            "rollout.max_tokens=6",
            "rollout.max_steps=2",
            "trainer.steps=2",
            "trainer.tasks_per_step=2",
            "trainer.mini_batches=2",
            "trainer.lr=3e-3",
            f"trainer.run_dir={tmp_path / 'run'}",
            "logging.progress=false",
            "algorithm.advantage={name: recording_grpo, gamma: 0.9, norm_by_std: false, whiten: true}",
            "algorithm.policy_loss={name: recording_ppo_clip, clip_low: 0.1, clip_high: 0.3, dual_clip: 3.0}",
            "algorithm.kl={coef: 0.05, estimator: recording_k3, penalty: reward}",
            "algorithm.loss_aggregation={name: recording_token_mean, equal_trajectory_weight: true, norm_len: 64}",
            "algorithm.off_policy={name: recording_mis_step, mis_low: 0.4, mis_high: 3.0}",
        ],
    )
    for seen in SEEN.values():
        seen.clear()
    trainer = Trainer(config, train_tasks=tasks(4))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.fit()
    assert any(not torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())

    algo = config.algorithm
    assert len(SEEN["advantage"]) == 2  # once per step
    for cfg, table in SEEN["advantage"]:
        assert cfg == algo.advantage
        # The reward penalty reached the estimator: -coef x KL (k3 of the sampler vs the reference).
        penalty = -0.05 * kl_penalty(table.old_logprobs, table.ref_logprobs, "k3", mask=table.response_mask)
        torch.testing.assert_close(table.token_rewards, penalty)
        assert table.traj_index.unique().numel() < table.num_steps  # multi-step trajectories
    assert SEEN["loss"] and all(cfg == algo.policy_loss for cfg, _ in SEEN["loss"])
    assert SEEN["kl"]  # called by the reward penalty (not as a loss term)
    assert len(SEEN["off_policy"]) == 2  # once per step, with the step ids
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "loss/policy" in r]
    # The engine shares the learner's model: its log-probs are the learner's, up to float rounding.
    assert all(r["off_policy/dropped_fraction"] == 0.0 and r["off_policy/kl_k3"] < 1e-6 for r in logged)
    for cfg, ids in SEEN["off_policy"]:
        assert cfg == algo.off_policy and ids["step_ids"].unique().numel() > ids["traj_ids"].unique().numel()
    assert SEEN["aggregation"]
    for norm_len, counts, mask in SEEN["aggregation"]:
        assert norm_len == 64.0
        # equal_trajectory_weight: each token's scope is its trajectory, not the whole mini-batch
        live = mask > 0
        assert counts.tokens_in_scope[live].max() < live.sum()


def test_the_trainer_passes_step_ids_to_gspo_and_seq_mean_where_steps_and_trajectories_differ(
    tiny_checkpoint, tmp_path
):
    """On a batch of two-step trajectories whose steps merge into one training sequence, GSPO's
    sequences and seq-mean-token-mean's are the steps: the loss sees one id per step, and the weights
    give every step (not every trajectory or packed row) the same total."""
    config = load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            "env.name=trainer_envs:LowByteEnv",
            "rollout.n=2",
            "rollout.max_tokens=6",
            "rollout.max_steps=2",
            "trainer.steps=1",
            "trainer.tasks_per_step=2",
            f"trainer.run_dir={tmp_path / 'run'}",
            "logging.progress=false",
            "algorithm.policy_loss=recording_gspo",
            "algorithm.loss_aggregation=seq-mean-token-mean",
        ],
    )
    trainer = Trainer(config, train_tasks=tasks(2))
    groups = trainer.rollout(trainer_tasks := tasks(2), 1)
    kept, _ = trainer.filter(trainer.score(groups, trainer_tasks))
    batch = trainer.batch(kept, 1)
    tokens = batch.tokens
    step_T, traj_T = tokens.step_ids, tokens.traj_ids
    rows = batch.rows
    expected_step = [r for r, s in enumerate(rows.steps) for _ in s.response_ids]
    assert step_T.tolist() == expected_step
    assert traj_T.tolist() == [rows.trajectory_index[r] for r in expected_step]
    assert step_T.unique().numel() > traj_T.unique().numel()  # steps and trajectories differ
    # Steps merged into one sequence each: a packed row is not what the loss groups by.
    # one mini-batch, far under the micro-batch token budget: one micro-batch holds every sequence
    assert [len(mini) for mini in batch.micro_batches] == [1]
    assert sum(len(s.spans) > 1 for s in batch.sequences) > 0

    weights_T = loss_weights(tokens.mask, tokens, trainer.config)
    live_steps = step_T[tokens.mask > 0].unique()
    per_step = torch.zeros(len(rows.steps)).index_add_(0, step_T, weights_T)[live_steps]
    torch.testing.assert_close(per_step, torch.full_like(per_step, 1 / len(live_steps)))

    SEEN["loss"].clear()
    context = trainer.context(1)
    phases.update.update(phases.advantages(batch, context)[0], context)
    trainer.close()
    seen_steps = torch.cat([ids for _, ids in SEEN["loss"]])
    assert sorted(seen_steps.tolist()) == sorted(step_T.tolist())  # every token once, with its step id
