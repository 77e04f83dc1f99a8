"""Attention by segments (``agent_r1.train.segment_attention``): the learner's SDPA path on the CPU.

The per-step definition is the guard in tests/test_batching_trie.py (which runs this path under
SDPA); here the path is compared with the dense tree mask it replaces on the same micro-batches,
with chunks small enough that every long segment is cut, and its planning and refusals are checked.
"""

from __future__ import annotations

import itertools
import math
import random
from dataclasses import replace

import pytest
import torch
from batching_support import TEMPERATURE
from test_batching_trie import (
    _groups_sharing_a_system_prompt,
    _rerendered,
    _sliding_window_group,
    _step,
    _tokens,
)
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

from agent_r1.train import segment_attention
from agent_r1.train.batch import batch_of
from agent_r1.train.learner import micro_batch_logprobs
from agent_r1.train.segment_attention import Segment, _bucket_splits, plan_segments
from agent_r1.types import Trajectory


def _trajectories():
    rng = random.Random(11)
    system = _tokens(rng, 40)
    _, window = _sliding_window_group(rng, system, samples=3, turns=6, k=2)
    duplicate = _groups_sharing_a_system_prompt(rng, system)
    duplicate.append(duplicate[-1])  # an identical sample: a member that adds no tokens
    return duplicate + window + [_rerendered(rng, system, 5)]


def _logprobs_and_grads(model, micro_batches, num_tokens: int):
    weights = torch.randn(num_tokens, generator=torch.Generator().manual_seed(5))
    model.zero_grad(set_to_none=True)
    out = torch.zeros(num_tokens)
    for mb in micro_batches:
        logprobs_K, entropy_K = micro_batch_logprobs(model, mb, TEMPERATURE, with_entropy=True)
        out = out.index_put((mb.flat_index_K,), logprobs_K + 0.1 * entropy_K)
    (weights * out).sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("chunk_queries", [3, None])
def test_segments_match_the_dense_tree_mask_forward_and_backward(tiny_checkpoint, monkeypatch, chunk_queries):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )
    trajectories = _trajectories()
    monkeypatch.setattr(segment_attention, "CHUNK_QUERIES", chunk_queries)
    batch = batch_of(trajectories, micro_batch_tokens=150, pair_cost=0.0)
    rows, micro_batches = batch.rows, batch.micro_batches[0]
    assert len(micro_batches) > 1 and any(mb.visible_until_BT is not None for mb in micro_batches)
    if chunk_queries is not None:  # every long segment really is cut
        longest = max(int(b.query_valid_NS.sum(1).max()) for mb in micro_batches for b in mb.segments.buckets)
        assert longest <= chunk_queries
    calls = []
    real_forward = segment_attention.segment_attention_forward

    def counting(*args, **kwargs):
        calls.append(1)
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(segment_attention, "segment_attention_forward", counting)
    segmented, segmented_grads = _logprobs_and_grads(model, micro_batches, rows.num_tokens)
    assert len(calls) == len(micro_batches) * model.config.num_hidden_layers  # the path really ran
    calls.clear()
    dense, dense_grads = _logprobs_and_grads(
        model, [replace(mb, segments=None) for mb in micro_batches], rows.num_tokens
    )
    assert not calls
    # The same softmax over the same keys per query, summed in another order: float32 rounding.
    torch.testing.assert_close(segmented, dense, atol=1e-5, rtol=0)
    assert dense_grads.keys() == segmented_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(segmented_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sequences_that_share_nothing_run_causally_in_place_and_match_the_dense_mask(tiny_checkpoint):
    """Without trees every segment is a run: no buckets, no gathers; the runs' outputs with the
    padding's zeros are the row layout. Compared with Hugging Face's own mask over the packed
    sequences (from the restarting positions), forward and backward."""
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )
    rng = random.Random(4)
    trajectories = []
    for first in range(3, 10):  # distinct first tokens: no two prompts share a prefix
        prompt, steps = [first] + _tokens(rng, rng.randint(5, 40)), []
        for _ in range(rng.randint(1, 3)):
            response = _tokens(rng, rng.randint(1, 12))
            steps.append(_step(prompt, response))
            prompt = prompt + response + _tokens(rng, rng.randint(2, 6))
        trajectories.append(Trajectory(task_id="t", steps=tuple(steps)))
    batch = batch_of(trajectories, micro_batch_tokens=90, pair_cost=0.0)
    rows, micro_batches = batch.rows, batch.micro_batches[0]
    assert len(micro_batches) > 1
    assert all(not mb.segments.buckets and mb.segments.runs for mb in micro_batches)
    segmented, segmented_grads = _logprobs_and_grads(model, micro_batches, rows.num_tokens)
    dense, dense_grads = _logprobs_and_grads(
        model, [replace(mb, segments=None) for mb in micro_batches], rows.num_tokens
    )
    # The same causal softmax per sequence, blocked differently: float32 rounding.
    torch.testing.assert_close(segmented, dense, atol=1e-5, rtol=0)
    assert dense_grads.keys() == segmented_grads.keys()
    for name, grad in dense_grads.items():
        torch.testing.assert_close(segmented_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_padding_positions_get_a_zero_output_and_no_nan():
    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 4, requires_grad=True)
    k = torch.randn(1, 1, 6, 4, requires_grad=True)
    v = torch.randn(1, 1, 6, 4, requires_grad=True)
    # positions 0-2 one sequence, 3 padding, 4-5 a member sharing position 0
    plan = plan_segments(
        [Segment(0, 3, torch.tensor([], dtype=torch.long)), Segment(4, 2, torch.tensor([0]))], 6
    )
    out, _ = segment_attention.segment_attention_forward(None, q, k, v, None, segment_attention=plan)
    assert out.shape == (1, 6, 2, 4) and torch.equal(out[0, 3], torch.zeros(2, 4))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))
    # position 4 attends to 0 and itself only
    scores = (q[0, :, 4] @ k[0, 0, [0, 4]].T) / 2.0
    expected = torch.softmax(scores, -1) @ v[0, 0, [0, 4]]
    torch.testing.assert_close(out[0, 4], expected)


def test_runs_with_padding_between_and_after_them_across_rows():
    """Runs only (the ordered path): two rows of width 5, padding inside a row and at the end;
    each run is causal attention over its own tokens, padding gets zeros."""
    torch.manual_seed(1)
    q = torch.randn(2, 2, 5, 4, requires_grad=True)
    k = torch.randn(2, 1, 5, 4, requires_grad=True)
    v = torch.randn(2, 1, 5, 4, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    # row 0: run 0-2, padding 3-4; row 1: run 5-6, run 7-8, padding 9
    plan = plan_segments([Segment(7, 2, empty), Segment(0, 3, empty), Segment(5, 2, empty)], 10)
    assert not plan.buckets and plan.runs == ((0, 3), (5, 2), (7, 2))
    out, _ = segment_attention.segment_attention_forward(None, q, k, v, None, segment_attention=plan)
    assert out.shape == (2, 5, 2, 4)
    for row, at, length in ((0, 0, 3), (1, 0, 2), (1, 2, 2)):
        for i in range(length):
            keys = k[row, 0, at : at + i + 1]
            expected = torch.softmax(q[row, :, at + i] @ keys.T / 2.0, -1) @ v[row, 0, at : at + i + 1]
            torch.testing.assert_close(out[row, at + i], expected)
    assert torch.equal(out[0, 3:], torch.zeros(2, 2, 4)) and torch.equal(out[1, 4], torch.zeros(2, 4))
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def _padded_pairs(sizes, ranges) -> int:
    total = 0
    for lo, hi in ranges:
        most_a, most_s = max(a for a, _ in sizes[lo:hi]), max(s for _, s in sizes[lo:hi])
        total += (hi - lo) * most_s * (most_a + most_s)
    return total


def test_bucketing_is_the_cheapest_split_that_keeps_each_size_class_whole():
    rng = random.Random(2)
    for _ in range(40):
        sizes = sorted(
            ((rng.choice([0, 0, 20, 183]), rng.randint(1, 300)) for _ in range(rng.randint(1, 7))), key=sum
        )
        overhead = rng.choice([0, 5_000, 50_000])
        ranges = _bucket_splits(sizes, overhead)
        assert [lo for lo, _ in ranges] == [0] + [hi for _, hi in ranges[:-1]] and ranges[-1][1] == len(sizes)
        keys = [int(math.log(max(sum(x), 1)) / math.log(1.05)) for x in sizes]
        cuts = [i for i in range(1, len(sizes)) if keys[i] != keys[i - 1]]  # where a split is allowed
        best = min(
            _padded_pairs(sizes, list(zip((0, *chosen), (*chosen, len(sizes)), strict=True)))
            + overhead * (len(chosen) + 1)
            for r in range(len(cuts) + 1)
            for chosen in itertools.combinations(cuts, r)
        )
        assert _padded_pairs(sizes, ranges) + overhead * len(ranges) == best


def test_overlapping_segments_are_refused():
    with pytest.raises(ValueError, match="overlap"):
        plan_segments(
            [
                Segment(0, 3, torch.zeros(0, dtype=torch.long)),
                Segment(2, 2, torch.zeros(0, dtype=torch.long)),
            ],
            4,
        )


def test_a_sliding_window_model_is_refused_not_computed_wrongly(tiny_tokenizer):
    config = Qwen2Config(
        vocab_size=len(tiny_tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
        attn_implementation="sdpa",
    )
    model = Qwen2ForCausalLM(config)
    trajectories = _trajectories()[:2]
    (mb,) = batch_of(trajectories, micro_batch_tokens=4096, pair_cost=0.0).all_micro_batches
    with pytest.raises(ValueError, match="sliding_window"):
        micro_batch_logprobs(model, mb, 1.0)


def test_install_wraps_sdpa_once_and_leaves_other_forwards_alone(tiny_checkpoint):
    from transformers.modeling_utils import AttentionInterface

    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation="sdpa"
    )
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with torch.no_grad():
        segment_attention.install()
        wrapped = AttentionInterface._global_mapping["sdpa"]
        segment_attention.install()
        assert AttentionInterface._global_mapping["sdpa"] is wrapped  # idempotent
        through_wrapper = model(input_ids=ids, attention_mask=mask).logits
        eager = AutoModelForCausalLM.from_pretrained(
            tiny_checkpoint, dtype=torch.float32, attn_implementation="eager"
        )
        expected = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(through_wrapper[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0)
