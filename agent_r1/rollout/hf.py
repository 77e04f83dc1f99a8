"""In-process Hugging Face engine with continuous batching.

Every ``generate`` call (one per live trajectory) becomes a request in a queue. One scheduler thread
owns the model and loops:

1. admit waiting requests (up to ``max_batch_size`` live rows): prefill them left-padded, with
   explicit ``position_ids`` (together, or on CPU in a few forwards of similar lengths), and merge
   their KV cache into the decode batch's;
2. run one batched decode step for every live row and sample each row's next token with its own
   ``SamplingParams`` (and its own ``torch.Generator`` when seeded);
3. retire rows that stopped (stop token / string, ``max_tokens``, context full, cancelled) and hand
   their ``Completion`` back to the caller's event loop.

Multi-turn reuse: when a request finishes, its KV (prompt + response) is kept in a small LRU store;
a later prompt that extends it (the next turn of the same trajectory under an append context) runs
only its new tokens. Any write to the weights (``update_weights``, or an optimizer stepping a model
the engine shares with the learner) empties the store.

Requests join and leave between decode steps, so a batch never waits for its longest member. Rows
sit left-padded in one ``DynamicCache``; padding is masked out and positions are explicit, so a
row's log-probs equal an unpadded forward over its own tokens (tested to 1e-4 in fp32). Weights are
copied in place between steps (``update_weights``); sequences in flight continue with the new
weights.

Deviation from vLLM: no paged attention; the batch cache is re-laid when rows join or leave
(a copy of the live KV, cheap next to a decode step for models that fit a CPU or one GPU).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import inspect
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import DynamicLayer

from agent_r1.rollout import cascade
from agent_r1.rollout.base import NamedTensors
from agent_r1.rollout.sampling import sample_next_tokens
from agent_r1.types import Completion, SamplingParams, StopReason

__all__ = ["HFEngine"]

_IDLE_EXIT_S = 1.0  # the scheduler thread ends after this long without work (no thread outlives use)
_SERVING: weakref.WeakSet[HFEngine] = weakref.WeakSet()  # engines whose scheduler thread may be running


@atexit.register
def _close_serving_engines() -> None:
    """Close every engine whose scheduler thread is still running when the interpreter exits (their
    pending requests end with ``ABORT``), so no thread is inside a forward at finalization: Python then
    ends a daemon thread that wants the GIL back with ``pthread_exit``, whose unwinding through
    PyTorch's C++ frames aborts the process ("terminate called without an active exception", exit
    134) after everything else succeeded."""
    for engine in list(_SERVING):
        engine.close()


# A forward's fixed cost on CPU, in prompt tokens: a 1-row prefill of 29 tokens took ~4 ms of the tiny
# model's time against ~0.09 ms per padded token slot in a 10-row one (the quickstart's rollout).
_CPU_FORWARD_OVERHEAD_TOKENS = 64


@dataclass(eq=False)
class _Request:
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)


def _resolve(future: asyncio.Future, completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)


class _GrowingLayer(DynamicLayer):
    """A ``DynamicLayer`` over a buffer with spare rows and spare columns both sides.

    ``DynamicLayer`` appends with ``torch.cat``, copying the whole cache at every decode step; here a
    step writes one column in place and ``keys`` / ``values`` are views of the filled block
    ``[:rows, :, start:end]``. Spare columns on the right take decode steps (the buffer doubles when
    full); spare rows and spare columns on the left let joining rows, even ones longer than the batch,
    be written in place (``append_rows``) instead of re-laying the whole cache. Buffers are allocated
    uninitialised (zeroing them cost a fifth of a multi-turn rollout's time); every slot is written
    before the view covers it (padding with zeros), so a masked slot never holds a non-finite value.
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._rows = self._start = self._end = 0

    def set(self, keys: torch.Tensor, values: torch.Tensor, *, rows: int = 0, left: int = 0, right: int = 0):
        """Hold exactly ``keys`` / ``values`` (B, H, T, D), with room for ``rows`` rows in all and
        ``left`` / ``right`` more positions."""
        batch, heads, length, _ = keys.shape
        rows, columns = max(rows, batch), left + length + right
        self._key_buffer = keys.new_empty(rows, heads, columns, keys.shape[-1])
        self._value_buffer = values.new_empty(rows, heads, columns, values.shape[-1])
        self._key_buffer[:batch, :, left : left + length] = keys
        self._value_buffer[:batch, :, left : left + length] = values
        self._rows, self._start, self._end = batch, left, left + length
        self._view()
        self.device = keys.device
        self.is_initialized = True

    def _view(self) -> None:
        self.keys = self._key_buffer[: self._rows, :, self._start : self._end]
        self.values = self._value_buffer[: self._rows, :, self._start : self._end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.set(key_states, value_states, right=key_states.shape[-2])
            return self.keys, self.values
        end = self._end + key_states.shape[-2]
        if end > self._key_buffer.shape[-2]:
            width = end - self._start
            self.set(self.keys, self.values, rows=self._key_buffer.shape[0], left=self._start, right=width)
            end = self._end + key_states.shape[-2]
        self._key_buffer[: self._rows, :, self._end : end] = key_states
        self._value_buffer[: self._rows, :, self._end : end] = value_states
        self._end = end
        self._view()
        return self.keys, self.values

    def reserve(self, rows: int, left: int) -> None:
        """Make room for ``rows`` rows in all and ``left`` more positions on the left (and as many on
        the right), re-laying the buffer only when it lacks either."""
        if self._key_buffer.shape[0] < rows or self._start < left:
            width = self._end - self._start
            self.set(self.keys, self.values, rows=rows, left=left, right=max(width, left))

    def fits(self, rows: int, length: int) -> bool:
        """Whether ``put_rows`` can add ``rows`` rows of ``length`` positions in place."""
        return self._rows + rows <= self._key_buffer.shape[0] and length <= self._end

    def put_rows(self, slots: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write rows (n, H, L, D) into row ``slots`` (finished rows', or the next new ones), right-aligned
        to the current end, widening the view to the left when ``L`` exceeds its width (the other rows'
        new columns are zero: padding). New rows need ``fits``."""
        length = keys.shape[-2]
        start = min(self._start, self._end - length)
        index = torch.tensor(slots, device=self._key_buffer.device)
        for buffer, new in ((self._key_buffer, keys), (self._value_buffer, values)):
            buffer[: self._rows, :, start : self._start] = 0  # the existing rows' new columns: padding
            buffer[index, :, start : self._end - length] = 0
            buffer[index, :, self._end - length : self._end] = new
        self._rows, self._start = max(self._rows, max(slots) + 1), start
        self._view()


def _padding_chunks(lengths: Sequence[int], overhead: int | None) -> list[list[int]]:
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


@dataclass(frozen=True)
class _Stored:
    """A finished sequence's KV kept for a next turn: the block it extends (or None) and its own
    tokens' keys and values per layer, each (H, T, D)."""

    block: cascade.Block | None
    kv: list[tuple[torch.Tensor, torch.Tensor]]


def _new_cache(num_layers: int) -> DynamicCache:
    cache = DynamicCache()
    cache.layers = [_GrowingLayer() for _ in range(num_layers)]
    return cache


class _Batch:
    """The decode batch: a left-padded KV cache of B rows, its mask (B, T), ``rows[i]``, the
    request in cache row ``i``, or None once that request finished, and ``blocks[i]``, the shared
    prompt block row ``i`` extends (its cache then holds only the tokens after it), or None.

    A finished row stays in the cache (its decode output is ignored) until a joining request takes its
    slot, or until finished rows make up half the batch: then the live rows are copied once into a
    fresh cache, so a copy happens O(log B) times per wave of finishing rows instead of at every
    retirement. (Multi-turn trajectories rejoin once per turn: filling finished rows' slots, their
    turns no longer run the buffers out of rows, which re-laid the whole cache.)

    The buffers always hold ``capacity`` rows (the engine's ``max_batch_size``): joining rows fill
    finished rows' slots before new ones, so the batch never has more rows than that, and a row that
    joins never re-lays the cache for want of one. (Sized to twice the live rows, the buffers ran out
    of rows in 7 of 80 joins over two iterations of ``benchmarks/vs_trl_multiturn.py``; a re-lay
    copies every live row's KV.)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.clear()

    def clear(self) -> None:
        self.rows: list[_Request | None] = []
        self.blocks: list[cascade.Block | None] = []
        self.cache: DynamicCache | None = None
        self.mask_BT: torch.Tensor | None = None
        self._block_plan: cascade.BlockPlan | None = None
        self._planned = False

    def block_plan(self, stacks, dtype: torch.dtype) -> cascade.BlockPlan | None:
        """The decode steps' blocks, rebuilt only after the rows changed."""
        if not self._planned:
            self._block_plan, self._planned = cascade.block_plan(self.blocks, stacks, dtype), True
        return self._block_plan

    def window(self) -> cascade.Window | None:
        """This decode step's split of the rows' own keys (``cascade.choose_window``)."""
        width = self.mask_BT.shape[1]
        first = self.mask_BT.argmax(dim=1).tolist()  # each row's first real column
        spans = [0 if r is None else width - f for r, f in zip(self.rows, first, strict=True)]
        chosen = cascade.choose_window(spans)
        if chosen is None:
            return None
        recent, rows = chosen
        return cascade.Window(recent, max(spans), torch.tensor(rows, device=self.mask_BT.device))

    @property
    def requests(self) -> list[_Request]:
        """The live requests, in row order."""
        return [r for r in self.rows if r is not None]

    @property
    def live_rows(self) -> list[int]:
        return [i for i, r in enumerate(self.rows) if r is not None]

    def merge(self, requests: list[_Request], cache: DynamicCache, mask_BT: torch.Tensor, blocks) -> None:
        """Append newly prefilled rows (their own cache and mask, and the blocks they extend): in place
        when the buffers have room, else by re-laying the live rows and the new ones into a fresh cache
        (finished rows dropped)."""
        self._planned = False
        if self.cache is None:
            for layer in cache.layers:  # room for joining rows, longer ones included, written in place
                layer.reserve(self.capacity, left=mask_BT.shape[1])
            self.rows, self.cache, self.mask_BT, self.blocks = list(requests), cache, mask_BT, list(blocks)
            return
        rows, length = mask_BT.shape
        free = [i for i, r in enumerate(self.rows) if r is None][:rows]
        slots = free + list(range(len(self.rows), len(self.rows) + rows - len(free)))
        if self.cache.layers[0].fits(rows - len(free), length):
            for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
                mine.put_rows(slots, theirs.keys, theirs.values)
            width = max(self.mask_BT.shape[1], length)
            grown = cascade.left_pad(self.mask_BT, width, 1)
            self.mask_BT = torch.cat([grown, grown.new_zeros(rows - len(free), width)])
            self.mask_BT[torch.tensor(slots, device=grown.device)] = cascade.left_pad(mask_BT, width, 1)
            self.rows += [None] * (rows - len(free))
            self.blocks += [None] * (rows - len(free))
            for slot, request, block in zip(slots, requests, blocks, strict=True):
                self.rows[slot], self.blocks[slot] = request, block
            return
        live = self.live_rows
        index = torch.tensor(live, device=self.mask_BT.device)
        mine_mask_BT, first = self._trimmed_mask(index)
        width = max(mine_mask_BT.shape[1], length)
        for mine, theirs in zip(self.cache.layers, cache.layers, strict=True):
            mine.set(
                *(
                    torch.cat(
                        [cascade.left_pad(a[index, :, first:], width, 2), cascade.left_pad(b, width, 2)]
                    )
                    for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values))
                ),
                rows=self.capacity,
                left=width,
                right=width,
            )
        self.mask_BT = torch.cat(
            [cascade.left_pad(mine_mask_BT, width, 1), cascade.left_pad(mask_BT, width, 1)]
        )
        self.rows = [self.rows[i] for i in live] + list(requests)
        self.blocks = [self.blocks[i] for i in live] + list(blocks)

    def retire(self, rows: list[int]) -> None:
        """Mark ``rows`` finished; compact the cache once finished rows are half of it or more."""
        for i in rows:
            self.rows[i] = self.blocks[i] = None
        self._planned = self._planned and not rows
        live = self.live_rows
        if not live:
            self.clear()
        elif rows and 2 * len(live) <= len(self.rows):
            index = torch.tensor(live, device=self.mask_BT.device)
            self.mask_BT, first = self._trimmed_mask(index)
            for layer in self.cache.layers:
                width = self.mask_BT.shape[1]
                layer.set(
                    layer.keys[index, :, first:],
                    layer.values[index, :, first:],
                    rows=self.capacity,
                    left=width,
                    right=width,
                )
            self.rows = [self.rows[i] for i in live]
            self.blocks = [self.blocks[i] for i in live]

    def _trimmed_mask(self, index: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The mask of rows ``index`` without the columns that are padding in all of them, and the
        first column kept."""
        mask_BT = self.mask_BT[index]
        first = int(mask_BT.any(dim=0).long().argmax())
        return mask_BT[:, first:], first


class HFEngine:
    """Continuous-batching engine over any Hugging Face causal LM, in this process.

    ``model``: a ``PreTrainedModel`` (kept on its device unless ``device`` is given; ``dtype`` casts
    it). ``tokenizer``: needed only for stop strings and ``Completion.text``. ``max_batch_size``:
    the most rows decoded together. ``eos_token_ids``: tokens that end a response besides each
    request's ``stop_token_ids`` (default: the model's generation config; ``()`` ignores end of
    sequence, e.g. for benchmarks that need exact lengths). ``max_context``: prompt + response
    limit (default: ``config.max_position_embeddings``). ``prefix_cache_entries``: how many finished
    sequences keep their KV for a next turn that extends them (default ``max_batch_size``; 0: off).
    ``prefix_hits`` counts prompts that reused one; ``shared_prefills`` counts prompts that joined
    together with an identical one and were prefilled once for both. ``cascade_attention``: hold
    such a shared prompt's KV once for all its rows, and attend to it, to the batch's recent columns
    and to the few long rows' older ones apart (``agent_r1.rollout.cascade``; default: on for
    ``sdpa`` models with plain attention in every layer).

    ``prefill_seconds`` / ``decode_seconds``: the scheduler's seconds so far prefilling joining
    prompts, and decoding (one step of every live row, sampling and retiring rows included); the
    rest of the time it waits for requests or for a weight update (a few clock reads per scheduler
    step; the trainer reports them per step as ``time/engine_*``).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        max_batch_size: int = 64,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        eos_token_ids: Sequence[int] | None = None,
        max_context: int | None = None,
        prefix_cache_entries: int | None = None,
        cascade_attention: bool | None = None,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        if device is not None or dtype is not None:
            model = model.to(device=device, dtype=dtype)
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        self.vocab_size = model.get_input_embeddings().num_embeddings
        self.max_context = max_context or getattr(model.config, "max_position_embeddings", None) or 2**31
        self.eos_token_ids = frozenset(
            self._default_eos_ids(model) if eos_token_ids is None else (int(t) for t in eos_token_ids)
        )
        self.weight_version: int | None = None
        self._attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        # a peft wrapper's forward takes **kwargs and passes them on: ask the model it wraps
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        forward_params = inspect.signature(base.forward).parameters
        self._cache_kwarg = "cache" if "cache" in forward_params else "past_key_values"
        self.prefix_cache_entries = max_batch_size if prefix_cache_entries is None else prefix_cache_entries
        can_share = self._attn_implementation == "sdpa" and cascade.plain_attention(model.config)
        if cascade_attention and not can_share:
            raise ValueError(
                f"HFEngine: cascade_attention needs sdpa attention with plain softmax in every layer; this model "
                f"has attn_implementation={self._attn_implementation!r} (a sliding window, soft-capping or "
                "sinks are not supported either)"
            )
        self.cascade_attention = can_share if cascade_attention is None else cascade_attention
        if self.cascade_attention:
            cascade.install()
        self._stacks = cascade.BlockStacks()
        self.prefix_hits = 0
        self.shared_prefills = 0
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        # token ids fed so far (prompt + response[:-1]) -> their block and own KV
        self._prefixes: OrderedDict[tuple[int, ...], _Stored] = OrderedDict()
        self._prefixes_fingerprint = self._weights_fingerprint()
        self._batch = _Batch(self.max_batch_size)
        self._waiting: list[_Request] = []
        self._wakeup = threading.Condition()
        self._model_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._closed = False

    @staticmethod
    def _default_eos_ids(model: PreTrainedModel) -> list[int]:
        generation_config = getattr(model, "generation_config", None)
        eos = getattr(generation_config, "eos_token_id", None)
        if eos is None:
            eos = getattr(model.config, "eos_token_id", None)
        if eos is None:
            return []
        return [eos] if isinstance(eos, int) else list(eos)

    @classmethod
    def from_pretrained(cls, path: str, **kwargs) -> HFEngine:
        """Load a model folder (and its tokenizer, via ``load_tokenizer``) into an engine."""
        from transformers import AutoModelForCausalLM

        from agent_r1.models.loading import load_tokenizer, quiet_progress_bars

        dtype = kwargs.pop("dtype", None)
        with quiet_progress_bars():
            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto")
        kwargs.setdefault("tokenizer", load_tokenizer(path, require_template=False))
        return cls(model, **kwargs)

    # ------------------------------------------------------------------ public API

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Sample one response; see ``agent_r1.rollout.base.Engine.generate``."""
        prompt_ids = tuple(int(t) for t in prompt_ids)
        rejected = self._reject(prompt_ids, params)
        if rejected is not None:
            return rejected
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        request = _Request(prompt_ids, params, loop, loop.create_future(), generator)
        self._submit(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Copy ``(name, tensor)`` pairs into the live model between decode steps.

        Names are the model's ``state_dict`` keys (Hugging Face names). An unknown name raises
        ``KeyError`` listing a few valid ones, before anything is copied.
        """
        state = self.model.state_dict()
        pairs = list(named_tensors)
        unknown = [name for name, _ in pairs if name not in state]
        if unknown:
            raise KeyError(
                f"HFEngine.update_weights: unknown parameter(s) {unknown[:5]}; "
                f"the model has e.g. {list(state)[:5]}"
            )
        with self._model_lock, torch.no_grad():
            for name, tensor in pairs:
                state[name].copy_(tensor)
        self.weight_version = version

    async def prompt_logprobs(
        self, prompt_ids: Sequence[int], top_k: int = 0
    ) -> list[dict[int, tuple[float, int]] | None]:
        """vLLM's prompt log-probs: for each prompt token after the first, ``{token id: (log-prob,
        rank)}`` of the prompt token itself and the ``top_k`` most likely ones, under ``log
        softmax(logits)`` over the full vocabulary (temperature 1, as vLLM); None for the first token.
        One forward pass, between the scheduler's decode steps."""
        ids = [int(t) for t in prompt_ids]
        rejected = self._reject(tuple(ids), SamplingParams())
        if rejected is not None:
            raise ValueError(rejected.error)
        return await asyncio.to_thread(self._prompt_logprobs, ids, top_k)

    def _prompt_logprobs(self, ids: list[int], top_k: int) -> list[dict[int, tuple[float, int]] | None]:
        with self._model_lock, torch.inference_mode():
            input_ids_1T = torch.tensor([ids], device=self.device)
            logits_TV = self.model(input_ids=input_ids_1T, use_cache=False).logits[0, :-1].float()
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1).cpu()
        target_T = torch.tensor(ids[1:])
        chosen_T = logprobs_TV.gather(1, target_T[:, None])[:, 0]
        rank_T = (logprobs_TV > chosen_T[:, None]).sum(1) + 1
        top_values_TK, top_ids_TK = logprobs_TV.topk(top_k, dim=-1) if top_k else (None, None)
        out: list[dict[int, tuple[float, int]] | None] = [None]
        for t in range(len(ids) - 1):
            entry = {ids[t + 1]: (float(chosen_T[t]), int(rank_T[t]))}
            for k in range(top_k):
                entry.setdefault(int(top_ids_TK[t, k]), (float(top_values_TK[t, k]), k + 1))
            out.append(entry)
        return out

    def close(self) -> None:
        """Refuse new requests and end pending ones with ``ABORT``. (Not needed for cleanup: the
        scheduler thread ends by itself once idle.)"""
        with self._wakeup:
            self._closed = True
            self._wakeup.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    # ------------------------------------------------------------------ request intake

    def _reject(self, prompt_ids: tuple[int, ...], params: SamplingParams) -> Completion | None:
        if self._closed:
            return Completion((), (), StopReason.ABORT, error="HFEngine is closed")
        if params.stop and self.tokenizer is None:
            return Completion(
                (), (), StopReason.ABORT, error="stop strings need HFEngine(tokenizer=...) to read text"
            )
        if not prompt_ids:
            return Completion((), (), StopReason.ABORT, error="empty prompt: nothing to condition on")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            return Completion(
                (),
                (),
                StopReason.ABORT,
                error=f"prompt has token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}",
            )
        if len(prompt_ids) >= self.max_context:
            return Completion(
                (),
                (),
                StopReason.LENGTH,
                error=f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_context}",
            )
        return None

    def _submit(self, request: _Request) -> None:
        with self._wakeup:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="HFEngine", daemon=True)
                self._thread.start()
                _SERVING.add(self)
            self._waiting.append(request)
            self._wakeup.notify()

    def _finish(self, request: _Request, reason: StopReason, error: str | None = None) -> None:
        text = None
        if self.tokenizer is not None:
            ids = request.token_ids
            if ids and reason is StopReason.STOP and self._is_stop_token(request, ids[-1]):
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        completion = Completion(request.token_ids, request.logprobs, reason, text=text, error=error)
        with contextlib.suppress(RuntimeError):  # the caller's event loop is gone; nobody is waiting
            request.loop.call_soon_threadsafe(_resolve, request.future, completion)

    # ------------------------------------------------------------------ scheduler thread

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                if not self._waiting and not self._batch.requests and not self._closed:
                    self._wakeup.wait(timeout=_IDLE_EXIT_S)
                if not self._waiting and not self._batch.requests:
                    self._thread = None  # idle: let the thread end; the next request starts another
                    return
                if self._closed:
                    break
                room = self.max_batch_size - len(self._batch.requests)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            joining = [r for r in joining if not r.cancelled]
            try:
                with self._model_lock, torch.inference_mode():
                    self._drop_stale_prefixes()  # once per step: weights change only between steps
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
                    self.prefill_seconds += prefilled - start
                    self.decode_seconds += time.perf_counter() - prefilled
            except Exception as e:  # a failed step fails its rows, never the engine
                failed = self._batch.requests + [r for r in joining if r not in self._batch.requests]
                self._batch = _Batch(self.max_batch_size)
                for request in failed:
                    self._finish(request, StopReason.ABORT, error=f"{type(e).__name__}: {e}")
        for request in self._batch.requests + self._waiting:
            self._finish(request, StopReason.ABORT, error="HFEngine closed")
        self._batch, self._waiting = _Batch(self.max_batch_size), []

    def _forward(self, input_ids_BS, mask_BT, position_ids_BS, cache, plan=None) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids_BS,
            attention_mask=self._attention_mask(mask_BT, input_ids_BS.shape[1]),
            position_ids=position_ids_BS,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
            **({} if plan is None else {"cascade": plan}),
        )
        return out.logits[:, -1, :]  # (B, V)

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

    def _prefill(self, requests: list[_Request]) -> None:
        """Run the prompts of joining requests and sample their first tokens.

        Requests with identical prompts (the samples of a group) are prefilled once: their rows get
        copies of its KV and logits, and each samples with its own generator. A prompt that extends a
        finished request's prompt + response reuses that KV (see ``prefix_cache_entries``) and runs
        only its new suffix. On CPU the distinct prompts are prefilled in chunks of similar suffix
        length (``_padding_chunks``): one forward pads every row to the longest suffix, and when one
        turn rejoins with a long tool result beside many short ones, the padding cost more than a
        second forward does.
        """
        by_prompt: dict[tuple[int, ...], list[_Request]] = {}
        for request in requests:
            by_prompt.setdefault(request.prompt_ids, []).append(request)
        self.shared_prefills += len(requests) - len(by_prompt)
        prompts = list(by_prompt)
        stored = self._claim_prefixes(prompts)
        suffix_lengths = [
            len(p) - (0 if key is None else len(key)) for p, key in zip(prompts, stored, strict=True)
        ]
        overhead = _CPU_FORWARD_OVERHEAD_TOKENS if self.device.type == "cpu" else None
        for chunk in _padding_chunks(suffix_lengths, overhead):
            self._prefill_rows([prompts[i] for i in chunk], [stored[i] for i in chunk], by_prompt)

    def _prefill_rows(self, prompts, stored, by_prompt: dict[tuple[int, ...], list[_Request]]) -> None:
        """One forward over distinct ``prompts`` (each reusing the claimed stored sequence ``stored[i]``
        or nothing), then rows for every request of each prompt, merged into the batch.

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
        suffixes = [p[n:] for p, n in zip(prompts, reused_lengths, strict=True)]
        past, length = max(own_lengths), max(len(x) for x in suffixes)
        ids_BS = torch.zeros(len(prompts), length, dtype=torch.long)
        mask_BT = torch.zeros(len(prompts), past + length, dtype=torch.long)
        position_ids_BS = torch.zeros(len(prompts), length, dtype=torch.long)
        for i, (own, n, suffix) in enumerate(zip(own_lengths, reused_lengths, suffixes, strict=True)):
            ids_BS[i, length - len(suffix) :] = torch.tensor(suffix)
            mask_BT[i, past - own : past] = 1
            mask_BT[i, past + length - len(suffix) :] = 1
            position_ids_BS[i, length - len(suffix) :] = torch.arange(n, n + len(suffix))
        cache = _new_cache(self.model.config.get_text_config().num_hidden_layers)
        if past:
            owns = [None if entry is None else entry.kv for entry in reused]
            for layer_index, layer in enumerate(cache.layers):
                keys, values = (
                    torch.stack([self._padded_kv(kv, owns, layer_index, j, past) for kv in owns])
                    for j in (0, 1)
                )
                layer.set(keys, values, right=past + length)
        blocks_plan = cascade.block_plan(blocks, self._stacks, self.model.dtype)
        plan = None if blocks_plan is None else cascade.CascadePlan(blocks=blocks_plan)
        logits_BV = self._forward(
            ids_BS.to(self.device), mask_BT.to(self.device), position_ids_BS.to(self.device), cache, plan
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
        as their own (the last token, for a new block's rows; else 0)."""
        own_from = [0] * len(prompts)
        if not self.cascade_attention:
            return own_from
        for i, p in enumerate(prompts):
            if blocks[i] is not None or len(by_prompt[p]) < 2 or len(p) < 2:
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
        plan = None
        if self.cascade_attention:
            blocks, window = batch.block_plan(self._stacks, self.model.dtype), batch.window()
            plan = None if blocks is None and window is None else cascade.CascadePlan(blocks, window)
        logits_BV = self._forward(ids_B1, batch.mask_BT, position_ids_B1, batch.cache, plan)
        live = batch.live_rows
        self._append_samples([batch.rows[i] for i in live], logits_BV[live])

    def _append_samples(self, requests: list[_Request], logits_BV: torch.Tensor) -> None:
        tokens_B, logprobs_B = sample_next_tokens(
            logits_BV, [r.params for r in requests], [r.generator for r in requests]
        )
        for request, token, logprob in zip(requests, tokens_B.tolist(), logprobs_B.tolist(), strict=True):
            request.token_ids.append(token)
            request.logprobs.append(logprob)

    def _is_stop_token(self, request: _Request, token: int) -> bool:
        return token in self.eos_token_ids or token in request.params.stop_token_ids

    def _stop_reason(self, request: _Request) -> StopReason | None:
        if request.cancelled:
            return StopReason.ABORT
        if self._is_stop_token(request, request.token_ids[-1]):
            return StopReason.STOP
        if request.params.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(request.token_ids, skip_special_tokens=False)
            if any(s in text for s in request.params.stop):
                return StopReason.STOP
        if len(request.token_ids) >= request.params.max_tokens or request.num_tokens >= self.max_context:
            return StopReason.LENGTH
        return None

    @staticmethod
    def _padded_kv(kv, reused, layer_index: int, j: int, length: int) -> torch.Tensor:
        """Row ``kv``'s own keys (j=0) or values (j=1) of one layer, left-padded to (H, length, D);
        zeros for a row that reuses nothing."""
        if kv is None:
            like = next(x for x in reused if x is not None)[layer_index][j]
            return like.new_zeros(like.shape[0], length, like.shape[2])
        return cascade.left_pad(kv[layer_index][j], length, 1)

    def _weights_fingerprint(self) -> int:
        """Sum of the parameters' in-place version counters: it changes whenever any weight is
        written (``update_weights``, or an optimizer stepping a model this engine shares)."""
        return sum(p._version for p in self.model.parameters())

    def _drop_stale_prefixes(self) -> None:
        fingerprint = self._weights_fingerprint()
        if fingerprint != self._prefixes_fingerprint:
            self._prefixes.clear()
            self._prefixes_fingerprint = fingerprint

    def _keep_prefix(self, row: int, request: _Request) -> None:
        """Store a finished row's KV under the tokens it covers, for a next turn that extends it."""
        fed = request.prompt_ids + tuple(request.token_ids[:-1])
        columns = self._batch.mask_BT[row].nonzero().squeeze(1)  # found once for every layer
        kv = [
            (layer.keys[row].index_select(1, columns), layer.values[row].index_select(1, columns))
            for layer in self._batch.cache.layers
        ]
        self._prefixes[fed] = _Stored(self._batch.blocks[row], kv)  # (index_select copies)
        self._prefixes.move_to_end(fed)
        while len(self._prefixes) > self.prefix_cache_entries:
            self._prefixes.popitem(last=False)

    def _claim_prefixes(self, prompts: list[tuple[int, ...]]) -> list[tuple[int, ...] | None]:
        """For each prompt, the longest stored sequence it strictly extends and no earlier prompt
        claimed, or None. (``_prefill_rows`` pops the claimed entries: each new request stores its own
        longer one.)"""
        claimed: list[tuple[int, ...] | None] = []
        for prompt_ids in prompts:
            best = None
            for fed in self._prefixes:
                if (
                    len(fed) < len(prompt_ids)
                    and (best is None or len(fed) > len(best))
                    and fed not in claimed
                    and prompt_ids[: len(fed)] == fed
                ):
                    best = fed
            claimed.append(best)
        return claimed

    def _retire(self) -> None:
        """Finish the rows whose newest token ended them; keep the rest in the batch."""
        finished = []
        for i, request in enumerate(self._batch.rows):
            reason = None if request is None else self._stop_reason(request)
            if reason is not None:
                if reason is not StopReason.ABORT and self.prefix_cache_entries > 0:
                    self._keep_prefix(i, request)
                self._finish(request, reason, error="cancelled" if reason is StopReason.ABORT else None)
                finished.append(i)
        self._batch.retire(finished)
