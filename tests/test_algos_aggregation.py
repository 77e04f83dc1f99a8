"""Loss aggregation: hand-computed values per mode, sequences and trajectories, and exact micro-batching."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent_r1.algos import LOSS_AGGREGATIONS, aggregate, aggregation_weights

LOSS = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])


def test_each_mode_by_hand_with_rows_as_sequences():
    assert aggregate(LOSS, MASK, "token-mean").item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)
    assert aggregate(LOSS, MASK, "seq-mean-token-sum-norm", norm_len=4).item() == pytest.approx(
        (6 + 4) / (2 * 4)
    )


def test_seq_ids_name_the_steps_inside_a_packed_row():
    loss = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    mask = torch.ones(1, 4)
    steps = torch.tensor([[5, 5, 8, 8]])
    assert aggregate(loss, mask, "seq-mean-token-mean", seq_ids=steps).item() == pytest.approx(
        (1.5 + 3.5) / 2
    )
    assert aggregate(loss, mask, "seq-mean-token-sum", seq_ids=steps).item() == pytest.approx((3 + 7) / 2)
    assert aggregate(loss, mask, "seq-mean-token-sum").item() == pytest.approx(10.0)  # one row = one sequence


def test_equal_trajectory_weight_by_hand():
    # trajectory 0 has two steps ([1, 1] and [3]); trajectory 1 one step ([10])
    loss = torch.tensor([[1.0, 1.0], [3.0, 0.0], [10.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    traj = torch.tensor([[0, 0], [0, 0], [1, 1]])

    def agg(mode, equal):
        return aggregate(loss, mask, mode, traj_ids=traj, equal_trajectory_weight=equal).item()

    assert agg("token-mean", False) == pytest.approx(15 / 4)
    assert agg("token-mean", True) == pytest.approx((5 / 3 + 10) / 2)
    assert agg("seq-mean-token-sum", False) == pytest.approx((2 + 3 + 10) / 3)
    assert agg("seq-mean-token-sum", True) == pytest.approx(((2 + 3) / 2 + 10) / 2)
    assert agg("seq-mean-token-mean", False) == pytest.approx((1 + 3 + 10) / 3)
    assert agg("seq-mean-token-mean", True) == pytest.approx(((1 + 3) / 2 + 10) / 2)
    # A constant per trajectory: the same with or without equal trajectory weight.
    for equal in (False, True):
        assert aggregate(
            loss, mask, "traj-mean-token-sum-norm", traj_ids=traj, norm_len=2, equal_trajectory_weight=equal
        ).item() == pytest.approx((2 + 3 + 10) / (2 * 2))


def test_masked_tokens_and_empty_batches_never_make_nan():
    loss = LOSS.clone()
    loss[MASK == 0] = float("nan")
    assert aggregate(loss, MASK, "token-mean").item() == pytest.approx(2.5)
    assert aggregate(loss, torch.zeros_like(MASK), "seq-mean-token-mean").item() == 0.0
    rows_without_tokens = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    assert aggregate(torch.ones(2, 2), rows_without_tokens, "seq-mean-token-sum").item() == 1.0


def test_errors_are_specific():
    with pytest.raises(
        ValueError, match="unknown loss aggregation 'mean'; available: (.*, )?seq-mean-token-mean, "
    ):
        aggregate(LOSS, MASK, "mean")
    with pytest.raises(ValueError, match="needs norm_len > 0"):
        aggregate(LOSS, MASK, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="'traj-mean-token-sum-norm' needs traj_ids"):
        aggregate(LOSS, MASK, "traj-mean-token-sum-norm", norm_len=4)
    with pytest.raises(ValueError, match="equal_trajectory_weight=True needs traj_ids"):
        aggregate(LOSS, MASK, "token-mean", equal_trajectory_weight=True)
    with pytest.raises(ValueError, match="a sequence id spans several trajectories"):
        aggregate(
            LOSS,
            MASK,
            "token-mean",
            traj_ids=torch.tensor([[0, 0, 1, 1], [2, 2, 2, 2]]),
            equal_trajectory_weight=True,
        )
    with pytest.raises(ValueError, match=r"seq_ids has shape \(2,\), mask has \(2, 4\)"):
        aggregate(LOSS, MASK, "token-mean", seq_ids=torch.zeros(2))


@st.composite
def packed_batches(draw):
    """Rows of packed tokens: each token names its step; steps belong to trajectories; some masked."""
    rows = draw(st.integers(1, 6))
    width = draw(st.integers(1, 6))
    generator = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    step_lengths = torch.randint(1, 4, (rows * width,), generator=generator)
    step_of_token = torch.repeat_interleave(torch.arange(rows * width), step_lengths)[: rows * width]
    steps = step_of_token.reshape(rows, width)
    trajectories = steps // 3  # three consecutive steps per trajectory
    mask = (torch.rand(rows, width, generator=generator) < 0.7).float()
    loss = torch.randn(rows, width, generator=generator, dtype=torch.float64)
    return loss, mask, steps, trajectories, draw(st.integers(1, rows))


@settings(max_examples=40)
@given(packed_batches(), st.sampled_from(sorted(LOSS_AGGREGATIONS)), st.booleans())
def test_micro_batch_losses_add_up_to_the_full_batch_loss(batch, mode, equal):
    loss, mask, steps, trajectories, cut = batch
    kw = {"norm_len": 6, "equal_trajectory_weight": equal}
    full = aggregate(loss, mask, mode, seq_ids=steps, traj_ids=trajectories, **kw)
    # As the learner does: weights over the whole mini-batch, split with its micro-batches' tokens.
    whole = aggregation_weights(mask, mode, seq_ids=steps, traj_ids=trajectories, **kw).to(loss.dtype)
    pieces = (whole[:cut] * loss[:cut]).sum() + (whole[cut:] * loss[cut:]).sum()
    assert torch.allclose(pieces, full, atol=1e-6)
    assert (whole[mask == 0] == 0).all()
    if mode in ("token-mean", "seq-mean-token-mean") and mask.any():
        assert whole.sum().item() == pytest.approx(1.0, abs=1e-5)  # the mean modes are averages


@settings(max_examples=40)
@given(packed_batches(), st.sampled_from(sorted(LOSS_AGGREGATIONS)), st.randoms(use_true_random=False))
def test_aggregation_does_not_depend_on_token_order(batch, mode, rnd):
    loss, mask, steps, trajectories, _ = batch
    perm = list(range(loss.numel()))
    rnd.shuffle(perm)
    perm = torch.tensor(perm)

    def flat(t):
        return t.reshape(-1)[perm]

    kw = {"norm_len": 6, "equal_trajectory_weight": True}
    a = aggregate(loss, mask, mode, seq_ids=steps, traj_ids=trajectories, **kw)
    b = aggregate(flat(loss), flat(mask), mode, seq_ids=flat(steps), traj_ids=flat(trajectories), **kw)
    assert torch.allclose(a, b)


def test_without_seq_ids_each_row_is_a_sequence():
    rows = torch.arange(MASK.shape[0])[:, None].expand(MASK.shape)
    assert torch.allclose(
        aggregation_weights(MASK, "seq-mean-token-mean"),
        aggregation_weights(MASK, "seq-mean-token-mean", seq_ids=rows),
    )
