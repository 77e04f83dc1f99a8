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

Several roles (``roles=``): each role is a LoRA adapter of the one base model (or the base model
itself), served through vLLM ``LoRARequest``s, so rows of every role decode in one batch. An adapter's
weights come from a folder saved by peft or from tensors in memory (``update_adapters``); each load
is a new ``LoRARequest`` (a new ``lora_int_id`` and name), so requests in flight finish with the
weights they started with, and vLLM's prefix cache (keyed by the LoRA name and path) never reuses KV
computed with an older version.

Deviation, on vLLM's CPU build only: its LoRA ops apply the last adapter slot to a row that runs no
adapter whenever rows of an adapter share its batch (the ``-1`` "no adapter" index read as the last
slot; vllm-project/vllm pull requests 48421 and 49656, open). There a base-model role runs a LoRA
adapter of zeros (loaded with the first adapter, in the first one's shapes), which adds exactly 0.

Needs the ``vllm`` package (``bash scripts/install_vllm.sh`` makes ``.venv-vllm`` with the CPU build).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import tempfile
import threading
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from agent_r1.rollout.base import LoraWeights, NamedTensors
from agent_r1.rollout.prompt_checks import refuse_prompt, refuse_role
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
    adapter: str | None = None  # the LoRA adapter of the request's role (None: the base model)
    lora: object | None = None  # the adapter's LoRARequest when the request was admitted
    cancelled: bool = False


def _resolve(future: asyncio.Future, completion: Completion) -> None:
    if not future.done():
        future.set_result(completion)


class VLLMEngine:
    """``generate`` / ``update_weights`` over an in-process ``vllm.LLM``.

    ``model``: a Hugging Face model folder. ``ignore_eos``: do not stop at end of sequence (for
    benchmarks with exact lengths). Other keyword arguments go to ``vllm.LLM`` (e.g. ``dtype``,
    ``max_model_len``, ``kv_cache_memory_bytes``, ``gpu_memory_utilization``, ``enable_prefix_caching``).

    ``roles``: serve several roles, each a LoRA adapter of ``model`` (``{role: adapter name}``) or the
    base model (``{role: None}``). A request runs the adapter of its ``SamplingParams.role``; one whose
    role is None or not in ``roles`` is answered at once with ``ABORT`` and an ``error`` naming the
    roles served, and one whose adapter has no weights loaded yet with ``ABORT`` saying so. Load (and
    replace) adapters with ``update_adapters``. LoRA is switched on in vLLM (``enable_lora``,
    ``max_loras``: one slot per adapter; ``max_lora_rank``: pass the adapters' rank, rounded up to a
    rank vLLM allows; vLLM's default is 16). Default None: ``SamplingParams.role`` is ignored.
    """

    def __init__(
        self,
        model: str,
        *,
        ignore_eos: bool = False,
        seed: int = 0,
        roles: Mapping[str, str | None] | None = None,
        **llm_kwargs,
    ) -> None:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.roles = None if roles is None else _checked_roles(roles)
        adapters = sorted({a for a in (self.roles or {}).values() if a is not None})
        # vLLM's CPU LoRA ops give base rows beside adapter rows the last slot (module docstring)
        self._zero_base = bool(adapters) and None in self.roles.values() and current_platform.is_cpu()
        if adapters:
            slots = len(adapters) + self._zero_base
            llm_kwargs = {"enable_lora": True, "max_loras": slots, **llm_kwargs}
            # room for each adapter's current and replaced weights, so that a replacement does not evict another
            llm_kwargs.setdefault("max_cpu_loras", 2 * llm_kwargs["max_loras"])
            if "max_lora_rank" in llm_kwargs:
                llm_kwargs["max_lora_rank"] = _vllm_lora_rank(llm_kwargs["max_lora_rank"])
        llm_kwargs.setdefault("logprobs_mode", "processed_logprobs")
        self.llm = LLM(model=str(model), seed=seed, **llm_kwargs)
        self.adapters: dict[str, object | None] = dict.fromkeys(adapters)  # name -> its LoRARequest
        self._retired: list = []  # replaced LoRARequests, unloaded once no running request uses them
        self._lora_ids = itertools.count(1)
        self._lora_folders: tempfile.TemporaryDirectory | None = None  # adapters loaded from tensors
        self._base_lora = None  # the zero adapter base-model roles run on vLLM's CPU build
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
        refused = refused or refuse_role("VLLMEngine", params.role, self.roles)
        if refused is not None:
            return refused
        loop = asyncio.get_running_loop()
        adapter = None if self.roles is None else self.roles[params.role]
        request = _Request(
            f"agent-r1-{next(self._ids)}", prompt_ids, params, loop, loop.create_future(), adapter
        )
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

    def update_weights(
        self,
        named_tensors: NamedTensors | Mapping[str, str | os.PathLike | LoraWeights],
        version: int | None = None,
    ) -> None:
        """Load ``(hf_name, tensor)`` pairs into the running model, then drop the prefix cache; or,
        given ``{adapter: folder or LoraWeights}`` (what the learner of several policies exports),
        load those adapters (``update_adapters``).

        Uses the worker's ``reload_weights`` (vLLM's in-place reload: Hugging Face names are mapped
        onto its fused layers and kernel-format weights are re-processed)."""
        if isinstance(named_tensors, Mapping):
            self.update_adapters(named_tensors, version)
            return
        weights = [(name, tensor.detach()) for name, tensor in named_tensors]
        with self._engine_lock:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
        self.weight_version = version

    def update_adapters(
        self, adapters: Mapping[str, str | os.PathLike | LoraWeights], version: int | None = None
    ) -> None:
        """Load (or replace) the weights of adapters served for ``roles``: ``{adapter: folder}`` (a
        folder peft's ``save_pretrained`` wrote: ``adapter_config.json`` and
        ``adapter_model.safetensors``; peft puts an adapter not named ``default`` in a subfolder of
        its name) or ``{adapter: LoraWeights}`` (tensors in memory, written to a folder of this
        engine's). Requests sampling now finish with the weights they started with; every later one
        runs the new weights. Raises naming the adapter for an adapter not served, a folder without
        an adapter, or weights vLLM refuses (a rank above ``max_lora_rank``, a module it cannot adapt)."""
        from vllm.lora.request import LoRARequest

        unknown = sorted(set(adapters) - set(self.adapters))
        if unknown:
            raise ValueError(
                f"VLLMEngine: adapters {unknown} are not served; roles use {sorted(self.adapters)}"
            )
        with self._engine_lock:
            for adapter, source in adapters.items():
                lora_id = next(self._lora_ids)
                if isinstance(source, LoraWeights):
                    path = self._write_adapter(source, lora_id)
                else:
                    path = Path(source).resolve()
                    if not (path / "adapter_config.json").is_file():
                        raise FileNotFoundError(
                            f"VLLMEngine: adapter {adapter!r}: {path} has no adapter_config.json (peft's "
                            "save_pretrained puts an adapter not named 'default' in a subfolder of its name)"
                        )
                request = self._add_lora(LoRARequest(f"{adapter}@{lora_id}", lora_id, str(path)), adapter)
                if self.adapters[adapter] is not None:
                    self._retired.append(self.adapters[adapter])
                self.adapters[adapter] = request
                if self._zero_base and self._base_lora is None:
                    self._base_lora = self._add_zero_adapter(path)
            self._unload_retired()
        self.weight_version = version

    def _add_lora(self, request, adapter: str):
        """Load ``request``'s adapter now (``add_lora``), so that weights vLLM refuses fail here."""
        try:
            self.llm.llm_engine.add_lora(request)
        except Exception as e:
            raise ValueError(
                f"VLLMEngine: vLLM refused adapter {adapter!r} from {request.lora_path}: {e}"
            ) from e
        return request

    def _add_zero_adapter(self, template: Path):
        """An adapter of zeros in the shapes of the one in folder ``template``: the base model."""
        from safetensors.torch import load_file
        from vllm.lora.request import LoRARequest

        weights = template / "adapter_model.safetensors"
        if not weights.is_file():
            raise ValueError(
                f"VLLMEngine: {template} has no adapter_model.safetensors, whose shapes the base model's "
                "zero adapter takes on vLLM's CPU build"
            )
        config = json.loads((template / "adapter_config.json").read_text())
        zeros = {name: t.zero_() for name, t in load_file(str(weights)).items()}
        lora_id = next(self._lora_ids)
        path = self._write_adapter(LoraWeights(config, zeros), lora_id)
        return self._add_lora(LoRARequest(f"base-model@{lora_id}", lora_id, str(path)), "(base model)")

    def _write_adapter(self, weights: LoraWeights, lora_id: int) -> Path:
        from safetensors.torch import save_file

        if self._lora_folders is None:
            self._lora_folders = tempfile.TemporaryDirectory(prefix="agent-r1-vllm-lora-")
        path = Path(self._lora_folders.name) / str(lora_id)
        path.mkdir()
        (path / "adapter_config.json").write_text(json.dumps(dict(weights.config)))
        tensors = {name: t.detach().cpu().contiguous() for name, t in weights.tensors.items()}
        save_file(tensors, str(path / "adapter_model.safetensors"))
        return path

    def _unload_retired(self) -> None:
        """Unload replaced adapters that no running request uses (the others at a later update)."""
        running = tuple(self._running.values())  # the scheduler thread retires requests meanwhile
        in_use = {r.lora.lora_int_id for r in running if r.lora is not None}
        written = None if self._lora_folders is None else Path(self._lora_folders.name)
        for request in [r for r in self._retired if r.lora_int_id not in in_use]:
            self.llm.llm_engine.remove_lora(request.lora_int_id)
            self._retired.remove(request)
            if Path(request.lora_path).parent == written:  # a folder of _write_adapter's
                shutil.rmtree(request.lora_path, ignore_errors=True)

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
        if request.adapter is None:
            request.lora = self._base_lora  # None but on vLLM's CPU build after the first adapter
        else:
            request.lora = self.adapters[request.adapter]
            if request.lora is None:
                error = (
                    f"VLLMEngine: adapter {request.adapter!r} of role {request.params.role!r} has no "
                    "weights yet: load them with update_adapters"
                )
                self._finish(request, Completion((), (), StopReason.ABORT, error=error))
                return
        try:
            engine.add_request(
                request.request_id,
                {"prompt_token_ids": request.prompt_ids},
                self._vllm_params(request.params),
                lora_request=request.lora,
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


def _checked_roles(roles: Mapping[str, str | None]) -> dict[str, str | None]:
    if not roles:
        raise ValueError("VLLMEngine: roles must name at least one role (or be None: one policy)")
    for role, adapter in roles.items():
        if not isinstance(role, str) or not role:
            raise TypeError(f"VLLMEngine: roles keys must be non-empty str role names, got {role!r}")
        if adapter is not None and (not isinstance(adapter, str) or not adapter):
            raise TypeError(f"VLLMEngine: roles[{role!r}] must be an adapter name or None, got {adapter!r}")
    return dict(roles)


def _vllm_lora_rank(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM allows that holds ``rank``."""
    from vllm.config.lora import MaxLoRARanks

    allowed = sorted(typing.get_args(MaxLoRARanks))
    fits = [r for r in allowed if r >= rank]
    if not fits:
        raise ValueError(f"VLLMEngine: LoRA rank {rank} is above vLLM's largest max_lora_rank {allowed[-1]}")
    return fits[0]


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
