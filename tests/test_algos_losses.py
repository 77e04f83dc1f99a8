"""Policy losses, TIS, value loss, KL estimators and entropy: hand-computed values and gradients."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.algos import (
    POLICY_LOSSES,
    PolicyLossConfig,
    aggregate,
    clipped_value_loss,
    get_policy_loss,
    kl_penalty,
)


def run(name, log_ratio, advantages, *, cfg=None, logprobs=None, mask=None, **kw):
    """Loss, metrics and d loss_sum / d logprobs for tokens with the given log-ratios to old_logprobs."""
    log_ratio = torch.tensor(log_ratio, dtype=torch.float64)
    base = (
        torch.full_like(log_ratio, -1.0) if logprobs is None else torch.tensor(logprobs, dtype=torch.float64)
    )
    logprobs_t = base.clone().requires_grad_(True)
    old = (base - log_ratio).detach()
    mask_t = torch.ones_like(log_ratio) if mask is None else torch.tensor(mask, dtype=torch.float64)
    adv = torch.tensor(advantages, dtype=torch.float64)
    # Hand values below use PPO's symmetric clip range (0.2 both sides) unless a test passes its own.
    cfg = cfg or PolicyLossConfig(clip_high=0.2)
    loss, metrics = get_policy_loss(name)(logprobs_t, old, adv, mask_t, cfg, **kw)
    loss.sum().backward()
    return loss.detach(), metrics, logprobs_t.grad


def test_ppo_clip_hand_values_and_gradients():
    r = [math.log(1.5), math.log(0.5), math.log(0.5), math.log(1.5)]
    loss, metrics, grad = run("ppo_clip", r, [1.0, 1.0, -1.0, -1.0])
    # A > 0, r = 1.5: max(-1.5, -1.2) = -1.2 (clipped, no gradient); A > 0, r = 0.5: max(-0.5, -0.8) = -0.5
    # A < 0, r = 0.5: max(0.5, 0.8) = 0.8 (clipped);                 A < 0, r = 1.5: max(1.5, 1.2) = 1.5
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 1.5])
    assert grad.tolist() == pytest.approx([0.0, -0.5, 0.0, 1.5])  # d(-A r)/d log pi = -A r
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)
    assert float(metrics["ratio_max"]) == pytest.approx(1.5)
    assert float(metrics["ratio_mean"]) == pytest.approx(1.0)
    k3 = 2 * (0.5 - math.log(1.5)) + 2 * (-0.5 - math.log(0.5))
    assert float(metrics["approx_kl"]) == pytest.approx(k3 / 4)


def test_ppo_clip_higher_and_dual_clip():
    loss, _, _ = run("ppo_clip", [math.log(1.5)], [1.0], cfg=PolicyLossConfig(clip_high=0.28))
    assert loss.tolist() == pytest.approx([-1.28])
    cfg = PolicyLossConfig(dual_clip=3.0)
    loss, metrics, grad = run("ppo_clip", [math.log(5.0), math.log(2.0)], [-1.0, -1.0], cfg=cfg)
    # r = 5: max(5, 1.2) = 5 > 3 -> 3 (no gradient); r = 2: 2 < 3 stays
    assert loss.tolist() == pytest.approx([3.0, 2.0])
    assert grad.tolist() == pytest.approx([0.0, 2.0])
    assert float(metrics["dual_clip_fraction"]) == pytest.approx(0.5)


def test_gspo_clips_the_length_normalised_sequence_ratio():
    # rows are sequences: row 0 log-ratios 0.1, -0.1 -> s = 1 (inside); row 1 0.2, 0.0 -> s = e^0.1 (outside)
    log_ratio = [[0.1, -0.1], [0.2, 0.0]]
    loss, _, grad = run("gspo", log_ratio, [[1.0, 1.0], [1.0, 1.0]])
    assert loss.flatten().tolist() == pytest.approx([-1.0, -1.0, -1.0004, -1.0004])
    assert grad.flatten().tolist() == pytest.approx([-1.0, -1.0, 0.0, 0.0])
    loss, metrics, grad = run("gspo", log_ratio, [[1.0, 1.0], [-1.0, -1.0]])
    s = math.exp(0.1)
    assert loss[1].tolist() == pytest.approx([s, s])  # A < 0: the unclipped term is the larger
    assert grad[1].tolist() == pytest.approx([s, s])  # each token carries the sequence ratio
    assert float(metrics["seq_ratio_mean"]) == pytest.approx((1 + s) / 2)


def test_gspo_sequences_follow_seq_ids_in_packed_rows():
    log_ratio = [[0.1, -0.1], [0.2, 0.0]]
    advantages = [[1.0, 1.0], [-1.0, -1.0]]
    two_rows, _, grad_rows = run("gspo", log_ratio, advantages)
    packed, _, grad_packed = run(
        "gspo", [[0.1, -0.1, 0.2, 0.0]], [[1.0, 1.0, -1.0, -1.0]], seq_ids=torch.tensor([[7, 7, 3, 3]])
    )
    assert torch.allclose(packed.reshape(2, 2), two_rows)
    assert torch.allclose(grad_packed.reshape(2, 2), grad_rows)


def test_cispo_weights_log_prob_by_a_clipped_detached_ratio():
    loss, metrics, grad = run("cispo", [math.log(6.0), math.log(0.5)], [1.0, 2.0], logprobs=[-0.5, -1.0])
    # weight min(6, 4) = 4: l = -4 * 1 * (-0.5) = 2, grad -4;  weight 0.5: l = -0.5 * 2 * (-1) = 1, grad -1
    assert loss.tolist() == pytest.approx([2.0, 1.0])
    assert grad.tolist() == pytest.approx([-4.0, -1.0])  # clipped tokens keep their gradient
    assert float(metrics["clip_fraction"]) == pytest.approx(0.5)


def test_reinforce_has_no_ratio():
    loss, _, grad = run("reinforce", [math.log(3.0), 0.0], [2.0, -1.0], logprobs=[-0.5, -2.0])
    assert loss.tolist() == pytest.approx([1.0, -2.0])
    assert grad.tolist() == pytest.approx([-2.0, 1.0])


def test_config_and_registry_errors_name_the_choices():
    with pytest.raises(
        ValueError, match="unknown policy loss 'ppo'; available: cispo, gspo, ppo_clip, (.*, )?reinforce"
    ):
        get_policy_loss("ppo")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        PolicyLossConfig(dual_clip=0.5)
    with pytest.raises(ValueError, match=r"cispo_ratio_max must be > cispo_ratio_min \(2.0\)"):
        PolicyLossConfig(cispo_ratio_min=2.0, cispo_ratio_max=1.0)
    with pytest.raises(ValueError, match=r"advantages has shape \(3,\), logprobs have \(2,\)"):
        get_policy_loss("ppo_clip")(
            torch.zeros(2), torch.zeros(2), torch.zeros(3), torch.ones(2), PolicyLossConfig()
        )


@settings(max_examples=25)
@given(
    st.lists(st.booleans(), min_size=2, max_size=12).filter(any),
    st.sampled_from([float("nan"), float("inf"), -float("inf"), 1e4]),
    st.integers(0, 2**31),
)
def test_masked_tokens_never_receive_gradient(mask_bits, garbage, seed):
    generator = torch.Generator().manual_seed(seed)
    n = len(mask_bits)
    mask = torch.tensor(mask_bits, dtype=torch.float32)
    masked = mask == 0

    def noisy():
        return torch.where(masked, torch.full((n,), garbage), torch.randn(n, generator=generator))

    old = noisy()
    cfg = PolicyLossConfig(dual_clip=3.0)
    for name, fn in POLICY_LOSSES.items():
        logprobs = noisy().requires_grad_(True)
        loss, metrics = fn(logprobs, old, noisy(), mask, cfg)
        aggregate(loss, mask, "token-mean").backward()
        assert torch.isfinite(logprobs.grad).all(), name
        assert (logprobs.grad[masked] == 0).all(), name
        assert (loss[masked] == 0).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name
    for kind in ("k1", "k2", "k3"):
        logprobs = noisy().requires_grad_(True)
        kl = kl_penalty(logprobs, noisy(), kind, mask=mask)
        aggregate(kl, mask, "token-mean").backward()
        assert torch.isfinite(logprobs.grad).all() and (logprobs.grad[masked] == 0).all(), kind
        assert (kl[masked] == 0).all(), kind
    values = noisy().requires_grad_(True)
    value_loss, _ = clipped_value_loss(values, noisy(), noisy(), mask)
    value_loss.sum().backward()
    assert torch.isfinite(values.grad).all() and (values.grad[masked] == 0).all()


def test_clipped_value_loss_hand_values():
    values = torch.tensor([1.0, 0.6], requires_grad=True)
    old = torch.tensor([0.5, 0.5])
    returns = torch.tensor([2.0, 2.0])
    loss, metrics = clipped_value_loss(values, old, returns, torch.ones(2), clip=0.2)
    # v = 1.0: unclipped (1 - 2)^2 = 1, clipped (0.7 - 2)^2 = 1.69 -> 0.845, no gradient (clamp saturated)
    # v = 0.6: inside the range, both 1.96 -> 0.98, gradient v - R = -1.4
    assert loss.tolist() == pytest.approx([0.845, 0.98])
    loss.sum().backward()
    assert values.grad.tolist() == pytest.approx([0.0, -1.4])
    assert float(metrics["value_clip_fraction"]) == pytest.approx(0.5)
    plain, _ = clipped_value_loss(values, old, returns, torch.ones(2), clip=None)
    assert plain.tolist() == pytest.approx([0.5, 0.98])


def test_kl_estimators_by_hand():
    logprobs = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.25)])
    x = math.log(2.0)
    assert kl_penalty(logprobs, ref, "k1").tolist() == pytest.approx([x, 0.0])
    assert kl_penalty(logprobs, ref, "k2").tolist() == pytest.approx([x * x / 2, 0.0])
    assert kl_penalty(logprobs, ref, "k3").tolist() == pytest.approx([0.5 - 1 + x, 0.0])
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'; available: k1, k2, k3"):
        kl_penalty(logprobs, ref, "k4")


def test_k1_and_k3_are_unbiased_for_kl_on_a_known_distribution():
    # pi = [0.5, 0.25, 0.25], ref = uniform; exact KL(pi || ref) = sum pi log(pi / ref)
    pi = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    ref = torch.full((3,), 1 / 3, dtype=torch.float64)
    exact = float((pi * (pi / ref).log()).sum())
    for kind in ("k1", "k3"):
        expectation = float((pi * kl_penalty(pi.log(), ref.log(), kind)).sum())
        assert expectation == pytest.approx(exact), kind
    assert (kl_penalty(pi.log(), ref.log(), "k2") >= 0).all()
    assert (kl_penalty(pi.log(), ref.log(), "k3") >= 0).all()
