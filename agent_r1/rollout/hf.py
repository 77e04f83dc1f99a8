"""In-process Hugging Face engine with continuous batching: the public API and the thread handoff.

Every ``generate`` call (one per live trajectory) is checked (``agent_r1.rollout.prompt_checks``)
and becomes a request in a queue. One scheduler thread owns the model and loops: it takes the
waiting requests that fit the batch and runs one ``Scheduler.step`` (``agent_r1.rollout.hf_scheduler``:
admit, decode one token for every live row, retire the rows that stopped); each finished request's
``Completion`` is handed back to its caller's event loop. The thread ends by itself once idle, and
starts again with the next request.

Multi-turn reuse: a finished sequence's KV is kept (``agent_r1.rollout.prefix_store``); a later prompt
that extends it runs only its new tokens. Rows sit left-padded in one cache
(``agent_r1.rollout.kv_cache``); padding is masked out and positions are explicit, so a row's
log-probs equal an unpadded forward over its own tokens (tested to 1e-4 in fp32). Weights are copied
in place between steps (``update_weights``); sequences in flight continue with the new weights.

Several roles (``roles=``): each role is a peft LoRA adapter of one shared model (or the base model);
a request names its role in ``SamplingParams.role`` and rows of every role decode in the same batch.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import re
import threading
import weakref
from collections.abc import Mapping, Sequence

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agent_r1.rollout import cascade, packed_linear
from agent_r1.rollout.base import LoraWeights, NamedTensors
from agent_r1.rollout.batch_invariant import matmuls_invariant, refuse_settings
from agent_r1.rollout.hf_scheduler import Request, Scheduler
from agent_r1.rollout.packed_linear import PackedLinears
from agent_r1.rollout.prefix_store import BASE_ADAPTER
from agent_r1.rollout.prompt_checks import refuse_prompt, refuse_role
from agent_r1.types import Completion, SamplingParams, StopReason

__all__ = ["HFEngine"]

log = logging.getLogger(__name__)

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


def _role_adapters(model: PreTrainedModel, roles: dict[str, str | None]) -> dict[str, str | None]:
    """Each role's adapter as the scheduler names it: the peft adapter, ``BASE_ADAPTER`` for the base
    model of a peft model, None for a plain model (which can only serve base-model roles). Raises
    naming the role when an adapter is missing or cannot join a mixed-adapter batch."""
    if not roles:
        raise ValueError("HFEngine: roles must name at least one role (or be None: one policy)")
    peft_config = getattr(model, "peft_config", None)
    adapters = {}
    for role, adapter in roles.items():
        if not isinstance(role, str) or not role:
            raise TypeError(f"HFEngine: roles keys must be non-empty str role names, got {role!r}")
        where = f"HFEngine: roles[{role!r}]"
        if adapter is None:
            adapters[role] = None if peft_config is None else BASE_ADAPTER
            continue
        if peft_config is None:
            raise ValueError(
                f"{where} names adapter {adapter!r}, but the model is not a peft model; wrap it with "
                "peft.get_peft_model and add the adapters (or map the role to None: the base model)"
            )
        if adapter not in peft_config:
            raise ValueError(f"{where}: the model has no adapter {adapter!r}; it has {sorted(peft_config)}")
        config = peft_config[adapter]
        if config.peft_type != "LORA" or getattr(config, "use_dora", False):
            raise ValueError(
                f"{where}: adapter {adapter!r} is {config.peft_type.value}"
                f"{' with DoRA' if getattr(config, 'use_dora', False) else ''}; peft mixes adapters "
                "in one batch for plain LoRA only"
            )
        adapters[role] = adapter
    return adapters


def _packed_linears(asked: bool | None, device: torch.device) -> bool:
    """Whether the engine's forwards run packed linears: ``asked`` (None: wherever possible)."""
    possible = device.type == "cpu" and packed_linear.available()
    if asked and not possible:
        raise ValueError(
            f"HFEngine(packed_linears=True) runs oneDNN's packed linear on the CPU; this engine is on "
            f"{device.type}{'' if device.type != 'cpu' else ' and this torch build has no oneDNN linear'}"
        )
    return possible if asked is None else asked


def _compute_dtype(asked: torch.dtype | str, device: torch.device, packed: bool) -> torch.dtype:
    """The engine's compute type ``asked`` (a dtype or its name), refused where it cannot run: on the
    CPU a narrower type needs the packed linears and a oneDNN kernel for it on this CPU."""
    dtype = getattr(torch, asked) if isinstance(asked, str) else asked
    if dtype == torch.float32 or device.type != "cpu":
        return dtype
    if dtype not in packed_linear.NARROW_TYPES:
        raise ValueError(f"HFEngine: compute_dtype must be float32, bfloat16 or float16, got {asked}")
    if not packed or not packed_linear.narrow_type_available(dtype):
        raise ValueError(
            f"HFEngine(compute_dtype={str(dtype).removeprefix('torch.')}) narrows the packed linear layers; "
            + (
                "packed_linears is off"
                if not packed
                else "this CPU or torch build has no oneDNN kernel for it"
            )
            + " (use float32)"
        )
    return dtype


def _resolve(future: asyncio.Future, completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)


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
    together with an identical one and were prefilled once for both; ``decode_steps`` counts decode
    forwards (each samples one token for every live row). ``cascade_attention``: hold
    such a shared prompt's KV once for all its rows, and attend to it, to the batch's recent columns
    and to the few long rows' older ones apart (``agent_r1.rollout.cascade``; default: on for
    ``sdpa`` models with plain attention in every layer).

    ``roles``: serve several roles at once, each a peft adapter of ``model`` (a ``PeftModel`` holding
    LoRA adapters, e.g. from ``get_peft_model`` + ``add_adapter``): ``{role: adapter name}``, or
    ``{role: None}`` for the base model with adapters off. A request runs the adapter of its
    ``SamplingParams.role``; rows of every role decode in one batch (peft's mixed-adapter forward). A
    request whose role is None or not in ``roles`` is answered at once with ``ABORT`` and an
    ``error`` naming the roles served. KV is never shared across adapters: identical prompts are
    prefilled once, and a stored turn reused, only within one adapter. Default None: the model runs
    as it is, and ``SamplingParams.role`` is ignored (one policy). ``prompt_logprobs`` always scores
    with the model as it is (its active adapter).

    ``batch_invariant``: every request's tokens and log-probs are bitwise the same whichever requests
    share its batch (``agent_r1.rollout.batch_invariant``; the deterministic mode's engine): rows still
    decode together, each prompt is prefilled alone, there is no shared-prompt attention, and every
    finished turn is stored (``prefix_cache_entries`` None: no limit, until the weights change; 0: no
    reuse). CPU at one torch thread, ``sdpa`` models with plain attention only (else ValueError).

    ``packed_linears``: run the engine's forwards' large linear layers (fp32 weights of at least 2^18
    elements) through oneDNN on weights packed once per weight version
    (``agent_r1.rollout.packed_linear``; the packed copies cost those weights' memory once more).
    Default: on for a CPU engine where this torch build has it; True where it has not raises
    ValueError. ``compute_dtype``: the packed layers' type (``torch.bfloat16`` or ``float16``: each
    weight's packed copy in it, input rounded to it, result fp32; everything else, the LM head
    included unless ``narrow_head``, fp32; on a GPU the forwards run under autocast in it). The
    effective type is ``self.compute_dtype`` (fp32 when no layer is packed, e.g. a tiny model).
    ``narrow_attention`` (default off): with a narrower ``compute_dtype`` on the CPU, the KV cache
    holds keys and values in it, and a decode step attends in it (``agent_r1.rollout.cascade``: its
    scores in it too, the softmax fp32; a prefill in fp32 over the narrow keys), as vLLM's do. Off
    by default: on the 2-core AMD host at 2 threads a SmolLM2 decode step at 32 rows and ~400
    positions took 170-218 ms with it against 157-167 without (the bf16 products need the cache's
    strided view copied first), though at 1 thread its attention was the faster (docs/precision.md).
    For models whose attention is more than plain softmax, and in the batch-invariant mode, the
    cache stays fp32 whatever is asked; ``self.kv_dtype`` says what it holds (on a GPU None: what
    autocast's forward writes).

    ``prefill_seconds`` / ``decode_seconds``: the scheduler's seconds so far prefilling joining
    prompts, and decoding (one step of every live row, sampling and retiring rows included); the
    rest of the time it waits for requests or for a weight update (a few clock reads per scheduler
    step; the trainer reports them per step as ``time/engine_*``). A step's seconds are added when it
    ends, which can be after it handed back its last completion: ``wait_for_step`` waits for that.
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
        roles: Mapping[str, str | None] | None = None,
        batch_invariant: bool = False,
        packed_linears: bool | None = None,
        compute_dtype: torch.dtype | str = torch.float32,
        narrow_head: bool = False,
        narrow_attention: bool = False,
    ) -> None:
        if max_batch_size < 1:
            raise ValueError(f"HFEngine: max_batch_size must be >= 1, got {max_batch_size}")
        self.roles = None if roles is None else dict(roles)
        self._adapter_of_role = None if roles is None else _role_adapters(model, self.roles)
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
        attn_implementation = getattr(model.config, "_attn_implementation", None) or "sdpa"
        can_share = attn_implementation == "sdpa" and cascade.plain_attention(model.config)
        self.packed_linears = _packed_linears(packed_linears, self.device)
        compute_dtype = _compute_dtype(compute_dtype, self.device, self.packed_linears)
        linears = PackedLinears(self.model, self.packed_linears, compute_dtype, narrow_head)
        # what the sampler computes in: a narrower type only where some layer runs in it
        parameters = next(self.model.parameters()).dtype
        if parameters != torch.float32:  # a model cast to a narrower type computes in it throughout
            self.compute_dtype = parameters
        else:
            self.compute_dtype = compute_dtype if linears.layers or self.device.type != "cpu" else parameters
        self.batch_invariant = batch_invariant
        if batch_invariant:
            refuse_settings(self.device, can_share, cascade_attention, prefix_cache_entries, roles)
            cascade_attention = False
            if not matmuls_invariant(self.model, max_batch_size, linears.linear):
                log.warning(
                    "HFEngine(batch_invariant=True): this CPU's matmul kernels round a row differently at "
                    "different batch sizes; decoding one request at a time instead (exact, and slower)"
                )
                self.max_batch_size = max_batch_size = 1
        if prefix_cache_entries is None:  # batch-invariant: no limit, nothing evicted by arrival
            prefix_cache_entries = None if batch_invariant else max_batch_size
        self.prefix_cache_entries = prefix_cache_entries
        if cascade_attention and not can_share:
            raise ValueError(
                f"HFEngine: cascade_attention needs sdpa attention with plain softmax in every layer; this model "
                f"has attn_implementation={attn_implementation!r} (a sliding window, soft-capping or "
                "sinks are not supported either)"
            )
        self.cascade_attention = can_share if cascade_attention is None else cascade_attention
        # on the CPU a narrow sampler keeps its KV cache, and attends to it, in its type (GPU: autocast)
        kv_dtype = None
        if (
            narrow_attention
            and self.device.type == "cpu"
            and self.compute_dtype in packed_linear.NARROW_TYPES
            and parameters == torch.float32
            and can_share
            and not batch_invariant
        ):
            kv_dtype = self.compute_dtype
        # what the cache holds; on a GPU, whatever the model's forward under autocast writes (None)
        self.kv_dtype = (parameters if kv_dtype is None else kv_dtype) if self.device.type == "cpu" else None
        if self.cascade_attention or kv_dtype is not None:
            cascade.install()
        self.prefill_seconds = 0.0
        self.decode_seconds = 0.0
        self._scheduler = Scheduler(
            self.model,
            tokenizer=tokenizer,
            max_batch_size=max_batch_size,
            eos_token_ids=self.eos_token_ids,
            max_context=self.max_context,
            prefix_cache_entries=self.prefix_cache_entries,
            cascade_attention=self.cascade_attention,
            attn_implementation=attn_implementation,
            finish=self._finish,
            batch_invariant=batch_invariant,
            linears=linears,
            kv_dtype=kv_dtype,
        )
        self._waiting: list[Request] = []
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

    @property
    def prefix_hits(self) -> int:
        return self._scheduler.prefix_hits

    @property
    def shared_prefills(self) -> int:
        return self._scheduler.shared_prefills

    @property
    def decode_steps(self) -> int:
        return self._scheduler.decode_steps

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
        rejected = self._reject(prompt_ids, params) or refuse_role("HFEngine", params.role, self.roles)
        if rejected is not None:
            return rejected
        loop = asyncio.get_running_loop()
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        adapter = None if self._adapter_of_role is None else self._adapter_of_role[params.role]
        request = Request(prompt_ids, params, loop, loop.create_future(), generator, adapter)
        self._submit(request)
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    def update_weights(
        self, named_tensors: NamedTensors | Mapping[str, LoraWeights], version: int | None = None
    ) -> None:
        """Copy ``(name, tensor)`` pairs into the live model between decode steps; or, given
        ``{adapter: LoraWeights}`` (what the learner of several policies exports), load each into the
        adapter of that name on this engine's peft model.

        Names are the model's ``state_dict`` keys (Hugging Face names). An unknown name raises
        ``KeyError`` listing a few valid ones, before anything is copied.
        """
        if isinstance(named_tensors, Mapping):
            named_tensors = self._adapter_pairs(named_tensors)
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

    def _adapter_pairs(self, adapters: Mapping[str, LoraWeights]) -> list[tuple[str, torch.Tensor]]:
        """``{adapter: LoraWeights}`` as this model's ``(state_dict name, tensor)`` pairs: peft saves
        ``...lora_A.weight``, the model holds ``...lora_A.<adapter>.weight``."""
        missing = [name for name in adapters if name not in getattr(self.model, "peft_config", {})]
        if missing:
            raise KeyError(f"HFEngine.update_weights: no adapter(s) {missing} on this engine's model")
        return [
            (re.sub(r"\.(lora_[A-Za-z_]+)\.", rf".\1.{adapter}.", name, count=1), tensor)
            for adapter, weights in adapters.items()
            for name, tensor in weights.tensors.items()
        ]

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

    def wait_for_step(self) -> None:
        """Return once no scheduler step is running. A step hands each finished request back before
        it ends, so a caller can hold its last completion while that step still runs;
        ``prefill_seconds`` / ``decode_seconds`` count it only once it has ended."""
        with self._model_lock:
            pass

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
        return refuse_prompt(prompt_ids, vocab_size=self.vocab_size, max_context=self.max_context)

    def _submit(self, request: Request) -> None:
        with self._wakeup:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="HFEngine", daemon=True)
                self._thread.start()
                _SERVING.add(self)
            self._waiting.append(request)
            self._wakeup.notify()

    def _finish(self, request: Request, reason: StopReason, error: str | None = None) -> None:
        text = None
        if self.tokenizer is not None:
            ids = request.token_ids
            if ids and reason is StopReason.STOP and request.stopped_by_token(self.eos_token_ids):
                ids = ids[:-1]
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        completion = Completion(request.token_ids, request.logprobs, reason, text=text, error=error)
        with contextlib.suppress(RuntimeError):  # the caller's event loop is gone; nobody is waiting
            request.loop.call_soon_threadsafe(_resolve, request.future, completion)

    # ------------------------------------------------------------------ scheduler thread

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                if not self._waiting and not self._scheduler.requests and not self._closed:
                    self._wakeup.wait(timeout=_IDLE_EXIT_S)
                if not self._waiting and not self._scheduler.requests:
                    self._thread = None  # idle: let the thread end; the next request starts another
                    return
                if self._closed:
                    break
                room = self.max_batch_size - len(self._scheduler.requests)
                joining, self._waiting = self._waiting[:room], self._waiting[room:]
            joining = [r for r in joining if not r.cancelled]
            try:
                with self._model_lock, torch.inference_mode():
                    prefill_seconds, decode_seconds = self._scheduler.step(joining)
                    self.prefill_seconds += prefill_seconds
                    self.decode_seconds += decode_seconds
            except Exception as e:  # a failed step fails its rows, never the engine
                live = self._scheduler.drop_all()
                failed = live + [r for r in joining if r not in live]
                for request in failed:
                    self._finish(request, StopReason.ABORT, error=f"{type(e).__name__}: {e}")
        for request in self._scheduler.drop_all() + self._waiting:
            self._finish(request, StopReason.ABORT, error="HFEngine closed")
        self._waiting = []
