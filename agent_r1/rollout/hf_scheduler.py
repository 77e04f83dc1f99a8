"""The HF engine's scheduler: continuous batching over one model, one step at a time.

``HFEngine``'s scheduler thread hands each ``Scheduler.step`` the requests joining the batch; a step

1. admits them (up to ``max_batch_size`` live rows): prefills them left-padded, with explicit
   ``position_ids`` (together, or on CPU in a few forwards of similar lengths, ``padding_chunks``),
   and merges their KV cache into the decode batch's (``agent_r1.rollout.kv_cache``);
2. runs one batched decode step for every live row and samples each row's next token with its own
   ``SamplingParams`` (and its own ``torch.Generator`` when seeded);
3. retires rows that stopped (stop token / string, ``max_tokens``, context full, cancelled) and hands
   each to the engine's ``finish`` callback, which returns its ``Completion`` to the caller.

Requests join and leave between decode steps, so a batch never waits for its longest member. A
prompt that extends a finished sequence reuses its stored KV (``agent_r1.rollout.prefix_store``);
a prompt that several requests share may be held once for all of them
(``agent_r1.rollout.cascade``).

Several roles in one batch: a request may name a peft adapter (``Request.adapter``); rows of
different adapters decode in the same forward (peft's ``adapter_names``, one per row, applied by
every LoRA layer to its rows alone). The attention itself has no weights, so blocks and windows
compose with it; what must not be shared across adapters is KV. Every reuse is keyed by (adapter,
token ids) (``PromptKey``): identical prompts are prefilled once, and made a block, only within one
adapter, and a stored turn serves only a next turn of the same adapter.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent_r1.rollout import batch_invariant as invariant
from agent_r1.rollout import cascade
from agent_r1.rollout.kv_cache import DecodeBatch, new_cache
from agent_r1.rollout.packed_linear import PackedLinears
from agent_r1.rollout.prefix_store import BASE_ADAPTER, PrefixStore, PromptKey, StoredPrefix
from agent_r1.rollout.sampling import sample_next_tokens
from agent_r1.types import SamplingParams, StopReason

__all__ = ["Request", "Scheduler", "padding_chunks"]

# A forward's fixed cost on CPU, in prompt tokens: a 1-row prefill of 29 tokens took ~4 ms of the tiny
# model's time against ~0.09 ms per padded token slot in a 10-row one (the quickstart's rollout).
_CPU_FORWARD_OVERHEAD_TOKENS = 64
# The most token slots one prefill forward runs on CPU; more rows go to further forwards. Past this, a
# forward's activations (each (slots, intermediate) fp32) outgrow the caches and every element-wise
# op streams them from memory: SmolLM2's prefill of 64 prompts of ~260 tokens took 26.2 s in one
# forward, 21.3 s in forwards of at most 4096 slots (unchanged at 32 prompts).
_CPU_PREFILL_SLOTS = 4096


@dataclass(eq=False)
class Request:
    """One ``generate`` call in flight: its prompt and sampling, the caller's event loop and future
    (the engine hands the ``Completion`` back through them), the peft adapter that runs it (a name,
    ``BASE_ADAPTER``, or None: the model as it is), and the tokens sampled so far."""

    prompt_ids: tuple[int, ...]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator | None
    adapter: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def prompt_key(self) -> PromptKey:
        return PromptKey(self.adapter, self.prompt_ids)

    def stopped_by_token(self, eos_token_ids: frozenset[int]) -> bool:
        """Whether the newest token ends the response (end of sequence, or one of its stop tokens)."""
        token = self.token_ids[-1]
        return token in eos_token_ids or token in self.params.stop_token_ids


def padding_chunks(lengths: Sequence[int], overhead: int | None) -> list[list[int]]:
    """Split rows of ``lengths`` tokens into forwards that each pad to their longest row, minimising
    the token slots run, counting each forward as ``overhead`` more (None: one forward for all).

    The optimal split of the rows sorted by length into contiguous runs, by dynamic programming over
    the sorted order (O(n^2), n distinct joining prompts)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if overhead is None or len(order) < 2:
        return [order]
    cost = [0.0] + [float("inf")] * len(order)  # cost[j]: the best split of the j shortest rows
    cut = [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        longest = lengths[order[j - 1]]
        for i in range(j):
            candidate = cost[i] + overhead + (j - i) * longest
            if candidate < cost[j]:
                cost[j], cut[j] = candidate, i
    chunks, j = [], len(order)
    while j:
        chunks.append(order[cut[j] : j])
        j = cut[j]
    return chunks[::-1]


def _within_slots(chunk: list[int], lengths: Sequence[int], slots: int | None) -> list[list[int]]:
    """``chunk`` (rows sorted by length, as ``padding_chunks`` gives them) cut into runs whose forward
    pads at most ``slots`` token slots (rows x the run's longest; a row longer than that runs alone);
    None: the whole chunk."""
    if slots is None:
        return [chunk]
    runs: list[list[int]] = [[]]
    for i in chunk:
        if runs[-1] and (len(runs[-1]) + 1) * lengths[i] > slots:
            runs.append([])
        runs[-1].append(i)
    return runs


def _padded_kv(kv, reused, layer_index: int, j: int, length: int) -> torch.Tensor:
    """Row ``kv``'s own keys (j=0) or values (j=1) of one layer, left-padded to (H, length, D);
    zeros for a row that reuses nothing."""
    if kv is None:
        like = next(x for x in reused if x is not None)[layer_index][j]
        return like.new_zeros(like.shape[0], length, like.shape[2])
    return cascade.left_pad(kv[layer_index][j], length, 1)


Finish = Callable[..., None]
"""``finish(request, reason, error=None)``: hand a retired request's ``Completion`` to its caller."""


class Scheduler:
    """The decode batch of one model and the steps that admit, decode and retire its rows.

    Every argument is ``HFEngine``'s setting of the same name (``attn_implementation``: the model's
    attention kernel; ``finish``: the engine's hand-back to callers; ``batch_invariant``: decode as
    ``agent_r1.rollout.batch_invariant`` says, every row's result independent of its batch;
    ``linears``: the engine's ``PackedLinears``, entered around every forward; None: none;
    ``kv_dtype``: the type the KV cache holds, attended by ``cascade.cascade_attention`` in it; None:
    the model's own).
    ``prefix_hits`` counts prompts that reused a stored sequence's KV; ``shared_prefills`` counts
    prompts that joined together with an identical one and were prefilled once for both;
    ``decode_steps`` counts decode forwards. Not thread-safe: the engine calls ``step`` from its
    scheduler thread only, holding its model lock.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        tokenizer: PreTrainedTokenizerBase | None,
        max_batch_size: int,
        eos_token_ids: frozenset[int],
        max_context: int,
        prefix_cache_entries: int | None,
        cascade_attention: bool,
        attn_implementation: str,
        finish: Finish,
        batch_invariant: bool = False,
        linears: PackedLinears | None = None,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.kv_dtype = kv_dtype
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.eos_token_ids = eos_token_ids
        self.max_context = max_context
        self.cascade_attention = cascade_attention
        self._attn_implementation = attn_implementation
        # a peft wrapper's forward takes **kwargs and passes them on: ask the model it wraps
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        forward_params = inspect.signature(base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self._finish = finish
        self._linears = PackedLinears(None) if linears is None else linears
        self._stacks = cascade.BlockStacks()
        self.prefix_hits = 0
        self.shared_prefills = 0
        self.decode_steps = 0
        # (adapter, token ids fed so far: prompt + response[:-1]) -> their block and own KV
        self._prefixes = PrefixStore(prefix_cache_entries, model)
        self.batch_invariant = batch_invariant
        if batch_invariant:
            invariant.install()
        self._batch: DecodeBatch[Request] = DecodeBatch(
            max_batch_size, invariant.padded_rows if batch_invariant else None
        )

    @property
    def requests(self) -> list[Request]:
        """The live requests, in row order."""
        return self._batch.requests

    def drop_all(self) -> list[Request]:
        """Empty the batch (after a failed step, or when the engine closes); return its live requests."""
        live = self._batch.requests
        self._batch.clear()
        return live

    def step(self, joining: list[Request]) -> tuple[float, float]:
        """Admit ``joining``, then decode one token for every live row, retiring the rows that stopped;
        return the seconds spent prefilling, and decoding (sampling and retiring included)."""
        self._prefixes.drop_stale()  # once per step: weights change only between steps
        start = time.perf_counter()
        if joining:
            self._prefill(joining)
        prefilled = time.perf_counter()
        if self._batch.requests:
            self._retire()
        if self._batch.requests:
            self._decode()
            self._retire()
        # (sampling reads the tokens back: on an accelerator the work is done by now)
        return prefilled - start, time.perf_counter() - prefilled

    def _forward(
        self, input_ids_BS, mask_BT, position_ids_BS, cache, plan=None, adapters=(), rowwise=None
    ) -> torch.Tensor:
        """The next-token logits (B, V) of every row; row ``i`` runs adapter ``adapters[i]`` (None:
        a finished row, or an engine that runs the model as it is; no adapters: all run it as it is).
        ``plan``: a ``cascade.CascadePlan``; ``rowwise``: a ``batch_invariant.RowSpans``."""
        with self._linears.active():
            out = self.model(
                input_ids=input_ids_BS,
                attention_mask=self._attention_mask(mask_BT, input_ids_BS.shape[1]),
                position_ids=position_ids_BS,
                use_cache=True,
                logits_to_keep=1,
                **{self._cache_kwarg: cache},
                **({} if plan is None else {"cascade": plan}),
                **({} if rowwise is None else {"rowwise": rowwise}),
                **self._adapter_names(adapters),
            )
        return out.logits[:, -1, :]  # (B, V)

    def _plan(
        self, blocks: cascade.BlockPlan | None, window: cascade.Window | None
    ) -> cascade.CascadePlan | None:
        """The forward's cascade plan; an empty one, rather than none, when the KV cache is narrow
        (cascade attention is then what attends to it, in its type)."""
        if blocks is None and window is None and self.kv_dtype is None:
            return None
        return cascade.CascadePlan(blocks, window)

    def _adapter_names(self, adapters: list[str | None]) -> dict[str, list[str]]:
        """peft's ``adapter_names`` keyword for rows of ``adapters``, or nothing when no row names one
        (single-policy engines call the model exactly as before)."""
        if all(a is None for a in adapters):
            return {}
        # With the adapters disabled (``disable_adapter()``), peft drops ``adapter_names`` and every
        # row would silently run the base model.
        if not self.model.has_active_enabled_adapter:
            raise RuntimeError("the model's adapters are disabled; rows of several roles cannot run")
        return {"adapter_names": [BASE_ADAPTER if a is None else a for a in adapters]}

    def _attention_mask(self, mask_BT: torch.Tensor, queries: int) -> torch.Tensor:
        """The mask to pass the model for ``queries`` new tokens (the last columns of ``mask_BT``).

        A decode step (one query) under ``sdpa`` or ``eager`` attention gets the 4D additive float
        mask (B, 1, 1, T), which transformers passes on as it is: from a 2D mask it builds a boolean
        one, and on CPU ``scaled_dot_product_attention`` with a boolean mask over a padded batch took
        ~1.3x as long as with a float one (measured at 128 rows x 600 positions). A prefill keeps
        the 2D mask: its 4D mask is (B, 1, S, T), and a float one would be 4x the boolean's memory.
        Other attention implementations (flash) take the 2D mask.
        """
        if queries > 1 or self._attn_implementation not in ("sdpa", "eager"):
            return mask_BT
        blocked = torch.finfo(self.model.dtype).min
        mask_B11T = torch.zeros(mask_BT.shape, dtype=self.model.dtype, device=mask_BT.device)
        return mask_B11T.masked_fill_(mask_BT == 0, blocked)[:, None, None, :]

    def _prefill(self, requests: list[Request]) -> None:
        """Run the prompts of joining requests and sample their first tokens.

        Requests with identical prompts (the samples of a group) are prefilled once: their rows get
        copies of its KV and logits, and each samples with its own generator. A prompt that extends a
        finished request's prompt + response reuses that KV (``agent_r1.rollout.prefix_store``) and runs
        only its new suffix. On CPU the distinct prompts are prefilled in chunks of similar suffix
        length (``padding_chunks``): one forward pads every row to the longest suffix, and when one
        turn rejoins with a long tool result beside many short ones, the padding cost more than a
        second forward does.
        """
        by_prompt: dict[PromptKey, list[Request]] = {}
        for request in requests:  # identical prompts of different adapters are different prompts
            by_prompt.setdefault(request.prompt_key, []).append(request)
        self.shared_prefills += len(requests) - len(by_prompt)
        prompts = list(by_prompt)
        stored = self._prefixes.claim(prompts)
        suffix_lengths = [
            len(p.token_ids) - (0 if key is None else len(key.token_ids))
            for p, key in zip(prompts, stored, strict=True)
        ]
        overhead = _CPU_FORWARD_OVERHEAD_TOKENS if self.device.type == "cpu" else None
        slots = _CPU_PREFILL_SLOTS if self.device.type == "cpu" else None
        if self.batch_invariant:  # each prompt alone: unpadded, a function of its own tokens
            chunks = [[i] for i in range(len(prompts))]
        else:
            chunks = padding_chunks(suffix_lengths, overhead)
        for chunk in chunks:
            for rows in _within_slots(chunk, suffix_lengths, slots):
                self._prefill_rows([prompts[i] for i in rows], [stored[i] for i in rows], by_prompt)

    def _prefill_rows(self, prompts, stored, by_prompt: dict[PromptKey, list[Request]]) -> None:
        """One forward over distinct ``prompts`` (each reusing the claimed stored sequence ``stored[i]``
        of its adapter, or nothing), then rows for every request of each prompt, merged into the batch.

        Row ``i`` is laid out as ``[pad, reused_i, pad, suffix_i]`` over ``(P + S)`` columns, where
        ``reused_i`` is the stored sequence's own KV (its block, if it has one, is attended apart); the
        mask hides the padding and ``position_ids`` continue from the reused length, so the result
        equals a full prefill. With ``cascade_attention``, a prompt that several requests share becomes
        a block: all its tokens but the last leave the rows' cache for one shared copy.
        """
        reused = [None if key is None else self._prefixes.pop(key) for key in stored]
        self.prefix_hits += sum(entry is not None for entry in reused)
        requests = [r for p in prompts for r in by_prompt[p]]
        copy_of = [i for i, p in enumerate(prompts) for _ in by_prompt[p]]
        blocks = [None if entry is None else entry.block for entry in reused]
        own_lengths = [0 if entry is None else entry.kv[0][0].shape[1] for entry in reused]
        reused_lengths = [
            n + (0 if b is None else b.length) for n, b in zip(own_lengths, blocks, strict=True)
        ]
        suffixes = [p.token_ids[n:] for p, n in zip(prompts, reused_lengths, strict=True)]
        past, length = max(own_lengths), max(len(x) for x in suffixes)
        ids_BS = torch.zeros(len(prompts), length, dtype=torch.long)
        mask_BT = torch.zeros(len(prompts), past + length, dtype=torch.long)
        position_ids_BS = torch.zeros(len(prompts), length, dtype=torch.long)
        for i, (own, n, suffix) in enumerate(zip(own_lengths, reused_lengths, suffixes, strict=True)):
            ids_BS[i, length - len(suffix) :] = torch.tensor(suffix)
            mask_BT[i, past - own : past] = 1
            mask_BT[i, past + length - len(suffix) :] = 1
            position_ids_BS[i, length - len(suffix) :] = torch.arange(n, n + len(suffix))
        cache = new_cache(self.model.config.get_text_config().num_hidden_layers, self.kv_dtype)
        if past:
            owns = [None if entry is None else entry.kv for entry in reused]
            for layer_index, layer in enumerate(cache.layers):
                keys, values = (
                    torch.stack([_padded_kv(kv, owns, layer_index, j, past) for kv in owns]) for j in (0, 1)
                )
                layer.set(keys, values, right=past + length)
        blocks_plan = cascade.block_plan(blocks, self._stacks, self.model.dtype)
        plan = self._plan(blocks_plan, None)
        logits_BV = self._forward(
            ids_BS.to(self.device),
            mask_BT.to(self.device),
            position_ids_BS.to(self.device),
            cache,
            plan,
            adapters=[p.adapter for p in prompts],
        )
        width = past + length
        own_from = self._share_prompts(prompts, blocks, by_prompt, cache, mask_BT)
        first = min(own_from)  # the columns before it are no row's own tokens any more
        if len(prompts) < len(requests) or first:
            index = torch.tensor(copy_of, device=self.device)
            for layer in cache.layers:
                layer.set(layer.keys[index, :, first:], layer.values[index, :, first:], right=width - first)
            logits_BV, mask_BT = logits_BV[index], mask_BT[index.cpu(), first:].clone()
            for row, i in enumerate(copy_of):
                mask_BT[row, : own_from[i] - first] = 0
        self._append_samples(requests, logits_BV)
        self._batch.merge(requests, cache, mask_BT.to(self.device), [blocks[i] for i in copy_of])

    def _share_prompts(self, prompts, blocks, by_prompt, cache, mask_BT) -> list[int]:
        """Make a block of every prompt of this prefill that several requests share and that extends
        none yet (``blocks`` is updated); return, per prompt row, the first cache column its rows keep
        as their own (the last token, for a new block's rows; else 0). A block's rows share one
        adapter: ``prompts`` are (adapter, token ids)."""
        own_from = [0] * len(prompts)
        if not self.cascade_attention:
            return own_from
        for i, p in enumerate(prompts):
            if blocks[i] is not None or len(by_prompt[p]) < 2 or len(p.token_ids) < 2:
                continue
            columns = mask_BT[i].nonzero().squeeze(1).to(self.device)
            shared = columns[:-1]
            blocks[i] = cascade.Block(
                [layer.keys[i][:, shared] for layer in cache.layers],
                [layer.values[i][:, shared] for layer in cache.layers],
            )
            own_from[i] = mask_BT.shape[1] - 1
        return own_from

    def _decode(self) -> None:
        """One step for every live row: feed its last token, sample the next."""
        batch = self._batch
        # A finished row is fed token 0 at position 0 until the next compaction; its output is unused.
        ids_B1 = torch.tensor([[r.token_ids[-1] if r else 0] for r in batch.rows], device=self.device)
        position_ids_B1 = torch.tensor(
            [[r.num_tokens - 1 if r else 0] for r in batch.rows], device=self.device
        )
        batch.mask_BT = torch.cat([batch.mask_BT, batch.mask_BT.new_ones(len(batch.rows), 1)], dim=1)
        blocks = window = None
        if self.cascade_attention:
            blocks, window = batch.block_plan(self._stacks, self.model.dtype), batch.window()
        plan = self._plan(blocks, window)
        rowwise = None
        if self.batch_invariant:
            spans = batch.mask_BT.sum(dim=1).tolist()
            rowwise = invariant.RowSpans(
                [0 if r is None else n for r, n in zip(batch.rows, spans, strict=True)]
            )
        adapters = [r.adapter if r else None for r in batch.rows]
        logits_BV = self._forward(
            ids_B1, batch.mask_BT, position_ids_B1, batch.cache, plan, adapters=adapters, rowwise=rowwise
        )
        self.decode_steps += 1
        live = batch.live_rows
        self._append_samples([batch.rows[i] for i in live], logits_BV[live])

    def _append_samples(self, requests: list[Request], logits_BV: torch.Tensor) -> None:
        tokens_B, logprobs_B = sample_next_tokens(
            logits_BV, [r.params for r in requests], [r.generator for r in requests]
        )
        for request, token, logprob in zip(requests, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            request.token_ids.append(token)
            request.logprobs.append(logprob)

    def _stop_reason(self, request: Request) -> StopReason | None:
        if request.cancelled:
            return StopReason.ABORT
        if request.stopped_by_token(self.eos_token_ids):
            return StopReason.STOP
        if request.params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
            if any(s in text for s in request.params.stop):
                return StopReason.STOP
        if len(request.token_ids) >= request.params.max_tokens or request.num_tokens >= self.max_context:
            return StopReason.LENGTH
        return None

    def _keep_prefix(self, row: int, request: Request) -> None:
        """Store a finished row's KV under its adapter and the tokens it covers, for a next turn (of
        the same adapter) that extends it."""
        fed = PromptKey(request.adapter, request.prompt_ids + tuple(request.token_ids[:-1]))
        kv = self._batch.own_kv(row)
        self._prefixes.keep(fed, StoredPrefix(self._batch.blocks[row], kv))  # (own_kv copies)

    def _retire(self) -> None:
        """Finish the rows whose newest token ended them; keep the rest in the batch."""
        finished = []
        for i, request in enumerate(self._batch.rows):
            reason = None if request is None else self._stop_reason(request)
            if reason is not None:
                if reason is not StopReason.ABORT and self._prefixes.keeps:
                    self._keep_prefix(i, request)
                self._finish(request, reason, error="cancelled" if reason is StopReason.ABORT else None)
                finished.append(i)
        self._batch.retire(finished)
