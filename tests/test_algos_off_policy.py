"""Off-policy corrections by name, against values computed by hand (agent_r1.algos.off_policy)."""

from __future__ import annotations

import math

import pytest
import torch

from agent_r1.algos import OffPolicyConfig, off_policy_correction
from agent_r1.train.config import ConfigError, config_from_dict


def correct(log_rho, cfg, *, mask=None, steps=None, trajectories=None):
    log_rho = torch.tensor(log_rho, dtype=torch.float64)
    n = len(log_rho)
    sampler = torch.full((n,), -2.0, dtype=torch.float64)
    return off_policy_correction(
        sampler + log_rho,
        sampler,
        torch.ones(n) if mask is None else torch.tensor(mask, dtype=torch.float64),
        cfg,
        step_ids=torch.arange(n) if steps is None else torch.tensor(steps),
        traj_ids=torch.zeros(n, dtype=torch.long) if trajectories is None else torch.tensor(trajectories),
    )


def test_tis_caps_the_token_ratio_and_drops_nothing():
    weight, keep, metrics = correct([math.log(3.0), math.log(0.5)], OffPolicyConfig("tis", tis_cap=2.0))
    assert weight.tolist() == pytest.approx([2.0, 0.5])
    assert keep.tolist() == [True, True]
    assert metrics["off_policy/weight_mean"] == pytest.approx(1.25)
    assert metrics["off_policy/ratio_mean"] == pytest.approx(1.75)
    assert metrics["off_policy/ratio_max"] == pytest.approx(3.0)
    assert metrics["off_policy/dropped_fraction"] == 0.0
    # k3 of KL(sampler || old): mean(rho - 1 - log rho)
    expected_kl = ((3 - 1 - math.log(3)) + (0.5 - 1 - math.log(0.5))) / 2
    assert metrics["off_policy/kl_k3"] == pytest.approx(expected_kl)


def test_icepop_masks_tokens_outside_its_range_and_weights_the_rest_by_their_ratio():
    weight, keep, metrics = correct([math.log(0.3), math.log(1.2), math.log(6.0)], OffPolicyConfig("icepop"))
    assert keep.tolist() == [False, True, False]  # [0.5, 5]
    assert weight.tolist() == pytest.approx([0.0, 1.2, 0.0])
    assert metrics["off_policy/dropped_fraction"] == pytest.approx(2 / 3)


def test_masked_is_drops_whole_steps_or_trajectories_by_their_product_ratio():
    log_rho = [math.log(2.0), math.log(2.0), math.log(1.5), math.log(1 / 1.2)]
    steps, trajectories = [0, 0, 1, 1], [0, 0, 0, 0]
    weight, keep, _ = correct(log_rho, OffPolicyConfig("mis_step"), steps=steps, trajectories=trajectories)
    assert keep.tolist() == [False, False, True, True]  # step 0: 2 x 2 = 4 > 2; step 1: 1.25
    assert weight.tolist() == pytest.approx([0.0, 0.0, 1.25, 1.25])
    _, keep, _ = correct(log_rho, OffPolicyConfig("mis_trajectory"), steps=steps, trajectories=trajectories)
    assert keep.tolist() == [False] * 4  # the trajectory: 4 x 1.25 = 5 > 2
    _, keep, _ = correct(log_rho, OffPolicyConfig("mis_trajectory"), steps=steps, trajectories=[0, 0, 1, 1])
    assert keep.tolist() == [False, False, True, True]


def test_masked_tokens_take_no_part_and_get_no_weight():
    # The second token is not trained (mask 0): its garbage ratio neither counts in the step's product
    # nor in the metrics, and its weight is 0.
    weight, keep, metrics = correct(
        [math.log(1.5), 50.0], OffPolicyConfig("mis_step"), mask=[1.0, 0.0], steps=[0, 0]
    )
    assert keep.tolist() == [True, False]
    assert weight.tolist() == pytest.approx([1.5, 0.0])
    assert metrics["off_policy/ratio_max"] == pytest.approx(1.5)


def test_bad_settings_and_names_are_refused_with_the_key():
    with pytest.raises(ConfigError, match="algorithm.off_policy.mis_high.*0 <= mis_low < 1 < mis_high"):
        config_from_dict({"algorithm": {"off_policy": {"name": "mis_step", "mis_high": 0.9}}})
    with pytest.raises(ConfigError, match="algorithm.off_policy.name.*unknown off-policy correction 'tiss'"):
        config_from_dict({"algorithm": {"off_policy": "tiss"}})
    with pytest.raises(ConfigError, match="moved to 'algorithm.off_policy.tis_cap"):
        config_from_dict({"algorithm": {"policy_loss": {"tis_cap": 2.0}}})
    with pytest.raises(ConfigError, match="old_logprobs: sampler makes them the same"):
        config_from_dict({"algorithm": {"off_policy": "tis", "old_logprobs": "sampler"}})
