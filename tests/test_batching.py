"""Prefix-merged training sequences and prefix trees give exactly the per-step log-probs and gradients."""

from __future__ import annotations

import random

import pytest
import torch
from batching_support import layout_logprobs_and_grads, reference_logprobs

from agent_r1.train.batch import batch_of
from agent_r1.train.batching import (
    SOFTMAX_MACS,
    TrainSequence,
    attention_pair_cost,
    count_tokens,
    pack_sequences,
    share_prefixes,
)
from agent_r1.train.learner import micro_batch_logprobs
from agent_r1.types import Step, Trajectory


def _step(prompt, response, rng):
    return Step(prompt_ids=prompt, response_ids=response, logprobs=[-1.0] * len(response))


def _multi_turn(rng: random.Random, turns: int, *, rewrite_at: int | None = None) -> Trajectory:
    """A trajectory whose next prompt = previous prompt + response + an observation (append context),
    except at ``rewrite_at`` where the context is rewritten (a fresh, shorter prompt)."""
    prompt = [rng.randrange(3, 250) for _ in range(rng.randint(5, 12))]
    steps = []
    for t in range(turns):
        if t == rewrite_at:
            prompt = [rng.randrange(3, 250) for _ in range(rng.randint(4, 8))]
        response = [rng.randrange(3, 250) for _ in range(rng.randint(1, 6))]
        steps.append(_step(prompt, response, rng))
        prompt = prompt + response + [rng.randrange(3, 250) for _ in range(rng.randint(2, 5))]
    return Trajectory(task_id="t", steps=tuple(steps))


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def test_merge_follows_prefixes_and_rewrites_start_new_sequences():
    rng = random.Random(0)
    appended = _multi_turn(rng, 4)
    rewritten = _multi_turn(rng, 4, rewrite_at=2)
    merged = batch_of([appended, rewritten], micro_batch_tokens=4096).sequences
    assert [len(s.spans) for s in merged] == [4, 2, 2]
    assert [span.row for s in merged for span in s.spans] == list(range(8))
    per_step = batch_of([appended, rewritten], micro_batch_tokens=4096, merge=False).sequences
    assert len(per_step) == 8
    # merged: the last prompt + response of each sequence; per step: every prompt again
    assert count_tokens(merged) < count_tokens(per_step)
    last = appended.steps[-1]
    assert merged[0].token_ids == last.prompt_ids + last.response_ids


def test_packing_respects_the_budget_and_keeps_every_sequence():
    rng = random.Random(1)
    sequences = batch_of(
        [_multi_turn(rng, 3) for _ in range(10)], micro_batch_tokens=4096, merge=False
    ).sequences
    bins = pack_sequences(sequences, token_budget=64)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in sequences)
    assert all(count_tokens(b) <= 64 or len(b) == 1 for b in bins)
    assert len(bins) < len(sequences)


def _layout_logprobs(model, trajectories, *, merge, budget):
    batch = batch_of(trajectories, micro_batch_tokens=budget, merge=merge)
    micro_batches = batch.micro_batches[0]
    out = torch.zeros(batch.num_tokens)
    for mb in micro_batches:
        logprobs_K, _ = micro_batch_logprobs(model, mb, 0.7)
        out = out.index_put((mb.flat_index_K,), logprobs_K)
    return out, micro_batches


@pytest.mark.parametrize("budget", [40, 4096])
def test_merged_and_per_step_layouts_give_the_same_logprobs(model, budget):
    rng = random.Random(2)
    trajectories = [_multi_turn(rng, 4), _multi_turn(rng, 3, rewrite_at=1), _multi_turn(rng, 1)]
    with torch.no_grad():
        expected = reference_logprobs(model, trajectories)
        merged, merged_mbs = _layout_logprobs(model, trajectories, merge=True, budget=budget)
        per_step, step_mbs = _layout_logprobs(model, trajectories, merge=False, budget=budget)
    assert torch.allclose(merged, expected, atol=1e-5, rtol=0)
    assert torch.allclose(per_step, expected, atol=1e-5, rtol=0)
    assert sum(mb.num_tokens for mb in merged_mbs) < sum(mb.num_tokens for mb in step_mbs)


def test_merged_and_per_step_layouts_give_the_same_gradients(model):
    rng = random.Random(3)
    trajectories = [_multi_turn(rng, 3), _multi_turn(rng, 4, rewrite_at=2)]
    num_tokens = batch_of(trajectories, micro_batch_tokens=4096).num_tokens
    weights = torch.randn(num_tokens, generator=torch.Generator().manual_seed(0))

    def grads(merge, budget):
        model.zero_grad(set_to_none=True)
        logprobs, _ = _layout_logprobs(model, trajectories, merge=merge, budget=budget)
        (weights * logprobs).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    merged = grads(True, 4096)
    per_step = grads(False, 30)
    model.zero_grad(set_to_none=True)
    assert merged.keys() == per_step.keys() and merged
    for name in merged:
        assert torch.allclose(merged[name], per_step[name], atol=1e-5, rtol=1e-4), name


def _groups(rng: random.Random, groups: int, size: int, turns: int) -> list[Trajectory]:
    """GRPO-shaped trajectories: every member of a group starts from the group's prompt; one member
    repeats its neighbour's first response (duplicates happen when a small model samples)."""
    trajectories = []
    for _ in range(groups):
        prompt = [rng.randrange(3, 250) for _ in range(rng.randint(20, 30))]
        for k in range(size):
            steps, context = [], prompt
            for t in range(turns):
                response = [rng.randrange(3, 250) for _ in range(rng.randint(1, 6))]
                if k == 1 and t == 0:
                    response = list(trajectories[-1].steps[0].response_ids)
                steps.append(_step(context, response, rng))
                context = context + response + [rng.randrange(3, 250) for _ in range(rng.randint(2, 5))]
            trajectories.append(Trajectory(task_id="t", steps=tuple(steps)))
    return trajectories


def test_share_prefixes_joins_a_group_where_the_cost_model_says_it_pays():
    rng = random.Random(4)
    sequences = batch_of(_groups(rng, 3, 4, 1), micro_batch_tokens=4096).sequences
    alone = share_prefixes(sequences, pair_cost=None, max_width=4096)
    assert [len(t.members) for t in alone] == [1] * 12 and count_tokens(alone) == count_tokens(sequences)
    trees = share_prefixes(sequences, pair_cost=1e-3, max_width=4096)
    # one tree per group, its trunk at least the group's prompt; every sequence kept exactly once
    assert sorted(len(t.members) for t in trees) == [4, 4, 4]
    assert sorted(id(s) for t in trees for s in t.members) == sorted(id(s) for s in sequences)
    for tree in trees:
        assert all(m.token_ids[: tree.trunk] == tree.members[0].token_ids[: tree.trunk] for m in tree.members)
        assert tree.trunk >= min(len(m.token_ids) for m in tree.members) - 6
    assert count_tokens(trees) < count_tokens(sequences) / 2
    # Two 40-token sequences sharing 10 tokens: a 70-token tree saves 10 tokens of dense layers but
    # costs 70^2 - 2 * 40^2 = 1700 more attention pairs; it pays only when a pair is cheap enough.
    a, b = (TrainSequence(tuple(range(10)) + tuple(range(k, k + 30)), ()) for k in (100, 200))
    assert [len(t.members) for t in share_prefixes([a, b], pair_cost=1e-3, max_width=4096)] == [2]
    assert [len(t.members) for t in share_prefixes([a, b], pair_cost=1e-2, max_width=4096)] == [1, 1]
    # a duplicate adds no width: it joins at any pair cost
    assert [len(t.members) for t in share_prefixes([a, a], pair_cost=1.0, max_width=4096)] == [2]
    narrow = share_prefixes(sequences, pair_cost=1e-3, max_width=40)
    assert all(len(t) <= 40 or len(t.members) == 1 for t in narrow)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_prefix_trees_give_the_per_step_logprobs_and_gradients(tiny_checkpoint, kernel):
    """Trees over groups (shared prompts, multi-turn members, a duplicate response) with several trees
    and plain sequences per row give exactly the per-step log-probs and gradients."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation=kernel
    )
    rng = random.Random(5)
    trajectories = _groups(rng, 3, 4, 2) + [_multi_turn(rng, 3, rewrite_at=1)]

    def run(pair_cost, budget):
        return layout_logprobs_and_grads(
            model, trajectories, merge=True, pair_cost=pair_cost, budget=budget, seed=1
        )

    with torch.no_grad():
        expected = reference_logprobs(model, trajectories)
    plain, plain_grads, plain_mbs = run(None, 4096)
    for budget in (4096, 120):
        trees, tree_grads, tree_mbs = run(1e-3, budget)
        assert any(mb.attention_BTT is not None for mb in tree_mbs)
        assert sum(mb.num_tokens for mb in tree_mbs) < sum(mb.num_tokens for mb in plain_mbs)
        assert torch.allclose(trees, expected, atol=1e-5, rtol=0)
        assert torch.allclose(trees, plain, atol=1e-5, rtol=0)
        for name in plain_grads:
            assert torch.allclose(tree_grads[name], plain_grads[name], atol=1e-5, rtol=1e-4), name


def test_a_kernel_without_custom_masks_refuses_trees_by_name(tiny_checkpoint, model):
    rng = random.Random(6)
    trajectories = _groups(rng, 1, 3, 1)
    (mb,) = batch_of(trajectories, micro_batch_tokens=4096, pair_cost=1e-3).all_micro_batches
    assert mb.attention_BTT is not None
    model.config._attn_implementation = "flash_attention_2"
    try:
        with pytest.raises(ValueError, match="share_prefixes: false"):
            micro_batch_logprobs(model, mb, 1.0)
    finally:
        model.config._attn_implementation = "sdpa"


def test_attention_pair_cost_from_the_config_dimensions():
    from transformers import Qwen2Config

    config = Qwen2Config(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    # per layer: q, o 64x64 each; k, v 64x32 each (2 kv heads of 16); MLP 3 x 64x128; LM head 64x100
    token = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128) + 64 * 100
    pair = 2 * 4 * (2 * 16 + SOFTMAX_MACS)
    assert attention_pair_cost(config) == pytest.approx(pair / token)
