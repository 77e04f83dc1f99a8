"""Prefix-merged training sequences give exactly the per-step log-probs and gradients."""

from __future__ import annotations

import random

import pytest
import torch

from agent_r1.train.batching import (
    build_sequences,
    count_tokens,
    make_micro_batches,
    pack_sequences,
    step_rows,
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
    merged = build_sequences([appended, rewritten])
    assert [len(s.spans) for s in merged] == [4, 2, 2]
    assert [span.row for s in merged for span in s.spans] == list(range(8))
    per_step = build_sequences([appended, rewritten], merge=False)
    assert len(per_step) == 8
    # merged: the last prompt + response of each sequence; per step: every prompt again
    assert count_tokens(merged) < count_tokens(per_step)
    last = appended.steps[-1]
    assert merged[0].token_ids == last.prompt_ids + last.response_ids


def test_packing_respects_the_budget_and_keeps_every_sequence():
    rng = random.Random(1)
    sequences = build_sequences([_multi_turn(rng, 3) for _ in range(10)], merge=False)
    bins = pack_sequences(sequences, token_budget=64)
    assert sorted(id(s) for b in bins for s in b) == sorted(id(s) for s in sequences)
    assert all(count_tokens(b) <= 64 or len(b) == 1 for b in bins)
    assert len(bins) < len(sequences)


def _unpacked_reference_logprobs(model, trajectories):
    """The definition: one forward per step over its own prompt + response, batch of one."""
    out = []
    for trajectory in trajectories:
        for step in trajectory.steps:
            ids = torch.tensor([step.prompt_ids + step.response_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float() / 0.7, -1)
            p = len(step.prompt_ids)
            positions = torch.arange(p - 1, p - 1 + len(step.response_ids))
            out.append(logprobs[positions, torch.tensor(step.response_ids)])
    return torch.cat(out)


def _layout_logprobs(model, trajectories, *, merge, budget):
    rows = step_rows(trajectories)
    micro_batches = make_micro_batches(build_sequences(trajectories, merge=merge), rows, budget)
    out = torch.zeros(rows.num_tokens)
    for mb in micro_batches:
        logprobs_K, _ = micro_batch_logprobs(model, mb, 0.7)
        out = out.index_put((mb.flat_index_K,), logprobs_K)
    return out, micro_batches


@pytest.mark.parametrize("budget", [40, 4096])
def test_merged_and_per_step_layouts_give_the_same_logprobs(model, budget):
    rng = random.Random(2)
    trajectories = [_multi_turn(rng, 4), _multi_turn(rng, 3, rewrite_at=1), _multi_turn(rng, 1)]
    with torch.no_grad():
        expected = _unpacked_reference_logprobs(model, trajectories)
        merged, merged_mbs = _layout_logprobs(model, trajectories, merge=True, budget=budget)
        per_step, step_mbs = _layout_logprobs(model, trajectories, merge=False, budget=budget)
    assert torch.allclose(merged, expected, atol=1e-5, rtol=0)
    assert torch.allclose(per_step, expected, atol=1e-5, rtol=0)
    assert sum(mb.num_tokens for mb in merged_mbs) < sum(mb.num_tokens for mb in step_mbs)


def test_merged_and_per_step_layouts_give_the_same_gradients(model):
    rng = random.Random(3)
    trajectories = [_multi_turn(rng, 3), _multi_turn(rng, 4, rewrite_at=2)]
    num_tokens = step_rows(trajectories).num_tokens
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
