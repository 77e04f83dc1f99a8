"""Cascade attention in the HF engine: shared prompt blocks and the decode window, merged exactly."""

from __future__ import annotations

import asyncio
import math
import types

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, Qwen2Config

from agent_r1.models.tiny import build_tiny_model
from agent_r1.rollout import HFEngine, cascade, packed_linear
from agent_r1.types import SamplingParams

BLOCKED = torch.finfo(torch.float32).min


def dense_reference(query, own_k, own_v, own_allowed, row_blocks, scaling):
    """Each row's softmax over its block's keys followed by its own, computed row by row.

    ``own_allowed`` (B, S, T) bool; ``row_blocks[b]``: (keys, values) of one layer, (KV, L, D), or
    None."""
    B, H, S, D = query.shape
    groups = H // own_k.shape[1]
    out = torch.empty(B, S, H, D)
    for b in range(B):
        keys, values, allowed = own_k[b], own_v[b], own_allowed[b]
        if row_blocks[b] is not None:
            block_k, block_v = row_blocks[b]
            keys, values = torch.cat([block_k, keys], dim=1), torch.cat([block_v, values], dim=1)
            allowed = torch.cat([torch.ones(S, block_k.shape[1], dtype=torch.bool), allowed], dim=1)
        for h in range(H):
            scores = query[b, h] @ keys[h // groups].T * scaling
            weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
            out[b, :, h] = weights @ values[h // groups]
    return out


def _module(layer: int = 0):
    return types.SimpleNamespace(layer_idx=layer)


def _case(seed: int, S: int, with_window: bool, dtype: torch.dtype = torch.float32):
    """Six rows (grouped-query heads: 4 query, 2 KV), left-padded own keys of different spans, two
    blocks of different lengths shared by rows 0-2 and 3-4, row 5 without one. ``dtype``: the type
    the keys and values are held in (the reference computes in fp32 over the query rounded to it)."""
    g = torch.Generator().manual_seed(seed)
    B, H, KV, T, D = 6, 4, 2, 12, 8
    query = torch.randn(B, H, S, D, generator=g)
    own_k, own_v = torch.randn(B, KV, T, D, generator=g), torch.randn(B, KV, T, D, generator=g)
    own_k, own_v = own_k.to(dtype), own_v.to(dtype)
    spans = [3, 12, 5, 1 + S, 9, 7]
    allowed = torch.zeros(B, S, T, dtype=torch.bool)
    for b, span in enumerate(spans):
        for s in range(S):  # causal over the last S columns, padding before each row's span
            allowed[b, s, T - span : T - S + s + 1] = True
    allowed[2, :, T - 4] = False  # a gap inside a row (a reused turn and its suffix, padded apart)
    blocks = [
        cascade.Block(
            [torch.randn(KV, n, D, generator=g).to(dtype)], [torch.randn(KV, n, D, generator=g).to(dtype)]
        )
        for n in (5, 9)
    ]
    row_blocks = [blocks[0]] * 3 + [blocks[1]] * 2 + [None]
    plan = cascade.block_plan(row_blocks, cascade.BlockStacks(), torch.float32)
    window = None
    if with_window:
        recent, rows = cascade.choose_window(spans)
        window = cascade.Window(recent, max(spans), torch.tensor(rows))
    mask = torch.zeros(B, 1, S, T).masked_fill_(~allowed[:, None], BLOCKED)
    reference = dense_reference(
        query.to(dtype).float(),
        own_k.float(),
        own_v.float(),
        allowed,
        [None if b is None else (b.keys[0].float(), b.values[0].float()) for b in row_blocks],
        0.3,
    )
    return query, own_k, own_v, mask, cascade.CascadePlan(plan, window), reference


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_blocks_and_the_window_give_the_dense_softmax(seed):
    """A decode step (one query per row) split into a block part, a recent window for all rows and
    the older columns for the long rows equals one softmax over block + own keys (fp32 rounding)."""
    query, k, v, mask, plan, reference = _case(seed, S=1, with_window=True)
    assert plan.window is not None and 0 < len(plan.window.rows_M) < 6
    out, _ = cascade.cascade_attention(_module(), query, k, v, mask, scaling=0.3, cascade=plan)
    assert out.shape == reference.shape
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mask_kind", ["float", "bool"])
def test_a_prefill_with_blocks_gives_the_dense_softmax(mask_kind):
    """Several queries per row (a later turn's suffix), causal under Hugging Face's 4D mask, float
    or boolean, plus the rows' blocks."""
    query, k, v, mask, plan, reference = _case(3, S=3, with_window=False)
    given_mask = mask if mask_kind == "float" else mask == 0
    out, _ = cascade.cascade_attention(_module(), query, k, v, given_mask, scaling=0.3, cascade=plan)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("S", [1, 3])
def test_a_bf16_kv_cache_is_attended_in_bf16_within_its_rounding(S):
    """The engine's bf16 KV cache (a bf16 sampler on the CPU) at a decode step's few queries per KV
    head: the queries are rounded to bf16 and the attention's products compute in it (blocks, window
    and merges included); the result comes back fp32.

    Against the dense softmax over the same rounded query, keys and values in fp32, each output may
    differ by: the scores rounded to bf16 (relative 2^-8 each, so each softmax weight moves by at most
    exp(2 x 2^-8 x max|score|) - 1, ~2.1 x 2^-8 x max|score|, in the weights of both a part and the
    merge of parts), the weights rounded to bf16 before they multiply the values (2^-8), and the
    outputs rounded to bf16 (each part's, the merged one's, the last one's: 3 x 2^-8 of |output| <=
    max|value|). So at most max|value| x 2^-8 x (4.2 x max|score| + 4)."""
    query, keys, values, mask, plan, reference = _case(5 + S, S=S, with_window=S == 1, dtype=torch.bfloat16)
    out, _ = cascade.cascade_attention(_module(), query, keys, values, mask, scaling=0.3, cascade=plan)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    every_key = torch.cat([keys.flatten(0, 2), plan.blocks.keys[0].flatten(0, 2)]).float()
    max_score = 0.3 * float((query.to(torch.bfloat16).float().flatten(0, 2) @ every_key.T).abs().max())
    every_value = torch.cat([values.flatten(0, 2), plan.blocks.values[0].flatten(0, 2)])
    bound = float(every_value.float().abs().max()) * 2.0**-8 * (4.2 * max_score + 4)
    assert float((out - reference).abs().max()) <= bound
    assert not torch.allclose(out, reference, atol=1e-6, rtol=0)  # it did compute in bf16


def test_a_bf16_kv_cache_with_many_queries_is_attended_in_fp32(monkeypatch):
    """A prefill's many queries per KV head run the CPU flash kernel in fp32 over the bf16 keys and
    values widened (faster there than its bf16 path): the fp32 softmax over the rounded values."""
    monkeypatch.setattr(cascade, "NARROW_PRODUCT_QUERIES", 4)  # the case: 2 query heads per KV head x 3 > 4
    query, keys, values, mask, plan, reference = _case(8, S=3, with_window=False, dtype=torch.bfloat16)
    out, _ = cascade.cascade_attention(_module(), query, keys, values, mask, scaling=0.3, cascade=plan)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


def test_no_mask_means_causal_over_the_own_keys():
    g = torch.Generator().manual_seed(4)
    query, k, v = (
        torch.randn(2, 4, 3, 8, generator=g),
        torch.randn(2, 2, 5, 8, generator=g),
        torch.randn(2, 2, 5, 8, generator=g),
    )
    block = cascade.Block([torch.randn(2, 4, 8, generator=g)], [torch.randn(2, 4, 8, generator=g)])
    plan = cascade.CascadePlan(cascade.block_plan([block, None], cascade.BlockStacks(), torch.float32))
    allowed = torch.ones(3, 5, dtype=torch.bool).tril(2)[None].expand(2, 3, 5)
    reference = dense_reference(query, k, v, allowed, [(block.keys[0], block.values[0]), None], 0.5)
    out, _ = cascade.cascade_attention(_module(), query, k, v, None, scaling=0.5, cascade=plan)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=1e-5)


@given(st.lists(st.integers(0, 60), min_size=1, max_size=24))
def test_the_window_reaches_every_key_and_reads_the_fewest(spans):
    """Every row whose span reaches before the recent columns is among the long rows, and no other
    split reads fewer keys (GATHER_COST per gathered key)."""
    spans = [max(s, 1) if i == 0 else s for i, s in enumerate(spans)]
    longest = max(spans)

    def cost(recent):
        return len(spans) * recent + cascade.GATHER_COST * sum(longest - recent for s in spans if s > recent)

    chosen = cascade.choose_window(spans)
    best = min(cost(r) for r in range(1, longest + 1))
    if chosen is None:
        assert cost(longest) == best
    else:
        recent, rows = chosen
        assert set(rows) >= {i for i, s in enumerate(spans) if s > recent}
        assert cost(recent) == best < cost(longest)


def test_models_whose_attention_is_not_plain_get_no_cascade(tiny_checkpoint):
    assert cascade.plain_attention(Qwen2Config(use_sliding_window=False))
    assert not cascade.plain_attention(
        Qwen2Config(use_sliding_window=True, sliding_window=16, max_window_layers=0)
    )
    eager = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, attn_implementation="eager")
    assert not HFEngine(eager).cascade_attention
    with pytest.raises(ValueError, match="cascade_attention needs sdpa attention"):
        HFEngine(eager, cascade_attention=True)


class PlanSpyEngine(HFEngine):
    """Test spy: counts the forwards that ran with blocks and with a decode window."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.with_blocks = self.with_window = 0
        forward = self._scheduler._forward

        def spied_forward(input_ids_BS, mask_BT, position_ids_BS, cache, plan=None, **kwargs):
            self.with_blocks += plan is not None and plan.blocks is not None
            self.with_window += plan is not None and plan.window is not None
            return forward(input_ids_BS, mask_BT, position_ids_BS, cache, plan, **kwargs)

        self._scheduler._forward = spied_forward


def learner_logprobs(model, prompt, token_ids) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return logits.log_softmax(-1)[positions, ids[0, len(prompt) :]]


def groups_turns_and_long_rows(engine) -> list[tuple[tuple[int, ...], object]]:
    """GRPO groups sharing prompts, their next turns reusing the stored KV with its block, and one
    long row beside them (so decode steps split off its older columns), on ``engine``: each turn's
    (prompt, completion)."""
    checks = []

    async def member(prompt, seed):
        ids = list(prompt)
        for turn in range(2):
            done = await engine.generate(
                ids, SamplingParams(temperature=1.0, max_tokens=6 + 5 * turn, seed=seed + turn)
            )
            checks.append((tuple(ids), done))
            ids = ids + list(done.token_ids) + [40 + turn, 41]

    async def main():
        groups = [[10 + (i * 7 + g) % 200 for i in range(20 + 9 * g)] for g in range(2)]
        long_row = [5 + (i * 3) % 190 for i in range(260)]
        with engine._wakeup:  # the engine thread takes the queue only once all are in it
            tasks = [
                asyncio.ensure_future(member(p, 100 * g + 10 * k))
                for g, p in enumerate(groups)
                for k in range(3)
            ]
            tasks.append(asyncio.ensure_future(member(long_row, 999)))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks)

    asyncio.run(main())
    return checks


def test_groups_turns_and_long_rows_match_the_learner(tiny_checkpoint):
    """Every row's log-probs equal the learner's unpadded recomputation, and blocks and windows were
    both used."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    engine = PlanSpyEngine(model, eos_token_ids=())
    assert engine.cascade_attention
    checks = groups_turns_and_long_rows(engine)
    assert engine.with_blocks and engine.with_window and engine.prefix_hits == 7
    for prompt, done in checks:
        assert done.error is None and len(done.token_ids) >= 6
        gap = (learner_logprobs(model, prompt, done.token_ids) - torch.tensor(done.logprobs)).abs().max()
        assert gap < 1e-4, (len(prompt), float(gap))


@pytest.mark.skipif(
    not packed_linear.narrow_type_available(torch.bfloat16), reason="no oneDNN bf16 linear on this CPU"
)
def test_a_bf16_engine_holds_its_kv_in_bf16_through_blocks_windows_and_turns():
    """The same groups, turns and long row on a bf16 sampler (a model with packed layers): its KV
    cache is bf16 and every forward attends to it through cascade attention (blocks, windows and
    stored turns included); the log-probs carry bf16's rounding (the attention's own error is bounded
    in ``test_a_bf16_kv_cache_is_attended_in_bf16_within_its_rounding``, the run's against the
    learner is what ``mismatch/*`` reports)."""
    torch.manual_seed(0)
    model = build_tiny_model(300, hidden_size=512, num_layers=2, intermediate_size=1024).eval()
    engine = PlanSpyEngine(model, eos_token_ids=(), compute_dtype=torch.bfloat16, narrow_attention=True)
    assert engine.kv_dtype == torch.bfloat16
    layers = []
    forward = engine._scheduler._forward

    def spied_forward(input_ids_BS, mask_BT, position_ids_BS, cache, plan=None, **kwargs):
        assert plan is not None  # a narrow cache is never attended by plain sdpa
        out = forward(input_ids_BS, mask_BT, position_ids_BS, cache, plan, **kwargs)
        layers.extend(layer.keys.dtype for layer in cache.layers)
        return out

    engine._scheduler._forward = spied_forward
    checks = groups_turns_and_long_rows(engine)
    assert engine.with_blocks and engine.with_window and engine.prefix_hits == 7
    assert set(layers) == {torch.bfloat16}
    gaps = []
    for prompt, done in checks:
        assert done.error is None and len(done.token_ids) >= 6
        assert all(math.isfinite(x) and x <= 0 for x in done.logprobs)
        gaps.append((learner_logprobs(model, prompt, done.token_ids) - torch.tensor(done.logprobs)).abs())
    assert float(torch.cat(gaps).max()) > 1e-4  # not the fp32 computation (its gap is below 1e-4)


def test_a_layer_asking_for_more_than_softmax_is_refused_by_name():
    query, k, v, mask, plan, _ = _case(0, S=1, with_window=False)
    with pytest.raises(
        ValueError, match=r"cascade attention computes plain softmax.*sliding_window.*cascade_attention=False"
    ):
        cascade.cascade_attention(_module(), query, k, v, mask, scaling=0.3, cascade=plan, sliding_window=8)
