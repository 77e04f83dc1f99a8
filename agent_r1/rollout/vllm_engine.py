"""In-process vLLM engine: token ids in, token ids and log-probs out.

A scheduler thread drives vLLM's own continuous batching (``LLMEngine.add_request`` / ``step``); each
``generate`` call is one vLLM request. Weights are loaded from the learner into the running model
(``update_weights``) between engine steps, and the prefix cache is reset so that no KV computed
with old weights is reused. Runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so that the model lives
in this process.

Log-probs: the engine is started with ``logprobs_mode="processed_logprobs"``, i.e.
``log softmax(logits / temperature)`` as ``agent_r1.types`` defines them (greedy: the raw
log-softmax). Deviation: with top-k / top-p truncation vLLM reports the log-prob *renormalised over
the kept tokens*, whereas the HF engine does not renormalise; the two agree whenever ``top_k=-1``
and ``top_p=1`` (the on-policy defaults). vLLM runs its own kernels, so its log-probs differ from
the learner's recomputation by a small numerical gap (measured in ``docs/rollout.md``).

Needs the ``vllm`` package (``bash scripts/install_vllm.sh`` makes ``.venv-vllm`` with the CPU build).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from agent_r1.rollout.base import NamedTensors
from agent_r1.rollout.prompt_checks import refuse_prompt
from agent_r1.types import Completion, SamplingParams, StopReason

__all__ = ["VLLMEngine"]

_IDLE_EXIT_S = 1.0


@dataclass(eq=False)
class _Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    cancelled: bool = False


def _resolve(future: asyncio.Future, completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)


class VLLMEngine:
    """``generate`` / ``update_weights`` over an in-process ``vllm.LLM``.

    ``model``: a Hugging Face model folder. ``ignore_eos``: do not stop at end of sequence (for
    benchmarks with exact lengths). Other keyword arguments go to ``vllm.LLM`` (e.g. ``dtype``,
    ``max_model_len``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``enable_prefix_caching``).
    """

    def __init__(self, model: str, *, ignore_eos: bool = False, seed: int = 0, **llm_kwargs) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = LLM(model=str(model), seed=seed, **llm_kwargs)
        self.max_context = self.llm.llm_engine.model_config.max_model_len
        self.vocab_size = self.llm.llm_engine.model_config.get_vocab_size()
        self.ignore_eos = ignore_eos
        self.weight_version: int | None = None
        self._ids = itertools.count()
        self._waiting: list[_Request] = []
        self._running: dict[str, _Request] = {}
        self._wakeup = threading.Condition()
        self._engine_lock = threading.Lock()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ public API

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Sample one response; see ``agent_r1.rollout.base.Engine.generate``."""
        prompt_ids = [int(t) for t in prompt_ids]
        refused = refuse_prompt(prompt_ids, vocab_size=self.vocab_size, max_context=self.max_context)
        if refused is not None:
            return refused
        loop = asyncio.get_running_loop()
        request = _Request(f"agent-r1-{next(self._ids)}", prompt_ids, params, loop, loop.create_future())
        with self._wakeup:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="VLLMEngine", daemon=True)
                self._thread.start()
            self._waiting.append(request)
            self._wakeup.notify()
        try:
            return await request.future
        except asyncio.CancelledError:
            request.cancelled = True
            raise

    def update_weights(self, named_tensors: NamedTensors, version: int | None = None) -> None:
        """Load ``(hf_name, tensor)`` pairs into the running model, then drop the prefix cache.

        Uses the worker's ``reload_weights`` (vLLM's in-place reload: Hugging Face names are mapped
        onto its fused layers and kernel-format weights are re-processed)."""
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._engine_lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        self.weight_version = version

    def sleep(self, level: int = 1) -> None:
        """Free the engine's accelerator memory while the learner trains (vLLM sleep mode: needs
        ``enable_sleep_mode=True`` and a GPU)."""
        with self._engine_lock:
            self.llm.sleep(level=level)

    def wake(self) -> None:
        with self._engine_lock:
            self.llm.wake_up()

    # ------------------------------------------------------------------ scheduler thread

    def _vllm_params(self, params: SamplingParams):
        from vllm import SamplingParams as VllmSamplingParams

        return VllmSamplingParams(
            n=1,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0 if params.top_k == -1 else params.top_k,
            max_tokens=params.max_tokens,
            stop_token_ids=list(params.stop_token_ids),
            stop=list(params.stop),
            include_stop_str_in_output=True,
            seed=params.seed,
            logprobs=0,
            ignore_eos=self.ignore_eos,
        )

    def _finish(self, request: _Request, completion: Completion) -> None:
        with contextlib.suppress(RuntimeError):  # the caller's event loop is gone
            request.loop.call_soon_threadsafe(_resolve, request.future, completion)

    def _admit(self, request: _Request) -> None:
        engine = self.llm.llm_engine
        try:
            engine.add_request(
                request.request_id,
                {"prompt_token_ids": request.prompt_ids},
                self._vllm_params(request.params),
            )
        except Exception as e:  # a request vLLM refuses (e.g. a token id outside the vocabulary) fails alone
            error = f"vLLM refused the request: {type(e).__name__}: {e}"
            self._finish(request, Completion((), (), StopReason.ABORT, error=error))
            return
        self._running[request.request_id] = request

    def _serve(self) -> None:
        engine = self.llm.llm_engine
        while True:
            with self._wakeup:
                if not self._waiting and not self._running:
                    self._wakeup.wait(timeout=_IDLE_EXIT_S)
                if not self._waiting and not self._running:
                    self._thread = None
                    return
                joining, self._waiting = self._waiting, []
            with self._engine_lock:
                for request in joining:
                    if not request.cancelled:
                        self._admit(request)
                cancelled = [rid for rid, r in self._running.items() if r.cancelled]
                if cancelled:
                    engine.abort_request(cancelled)
                    for rid in cancelled:
                        del self._running[rid]
                if not self._running:
                    continue
                try:
                    outputs = engine.step()
                except Exception as e:  # a failed step fails its requests, not the engine
                    engine.abort_request(list(self._running))
                    failed, self._running = self._running, {}
                    for request in failed.values():
                        error = f"vLLM step failed: {type(e).__name__}: {e}"
                        self._finish(request, Completion((), (), StopReason.ABORT, error=error))
                    continue
            for output in outputs:
                if output.finished and output.request_id in self._running:
                    self._finish(self._running.pop(output.request_id), _to_completion(output))


def _to_completion(output) -> Completion:
    sample = output.outputs[0]
    steps = sample.logprobs if sample.logprobs is not None else []
    token_ids = list(sample.token_ids)[: len(steps)]  # an aborted request may lack log-probs
    logprobs = [step[token].logprob for step, token in zip(steps, token_ids, strict=False)]
    reason = {"stop": StopReason.STOP, "length": StopReason.LENGTH}.get(
        sample.finish_reason, StopReason.ABORT
    )
    error = None if reason is not StopReason.ABORT else f"vLLM finish reason {sample.finish_reason!r}"
    return Completion(token_ids, logprobs, reason, text=sample.text, error=error)
