"""``agent-r1 serve MODEL``: serve a model folder over HTTP with the OpenAI API.

``/v1/completions`` (token-id or text prompts; token ids and log-probs back), ``/v1/chat/completions``
(the tokenizer's chat template), ``/v1/models`` and ``/health``; see ``agent_r1.rollout.server``.
The HF engine runs anywhere; ``--engine vllm`` needs the ``vllm`` package (``.venv-vllm``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

HELP = "Serve a model over HTTP with the OpenAI completions / chat API (token ids and log-probs)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face model folder (weights + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--engine", choices=("hf", "vllm"), default="hf", help="rollout engine (default: %(default)s)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="the model name clients send (default: the folder name)"
    )
    parser.add_argument("--max-batch-size", type=int, default=64, help="HF engine: rows decoded together")
    parser.add_argument("--device", default=None, help="HF engine: torch device (default: where it loads)")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="weights dtype (default: the checkpoint's)",
    )
    parser.add_argument("--max-context", type=int, default=None, help="prompt + response token limit")
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=None,
        help="vLLM engine: KV-cache memory in GiB (set it on CPU: vLLM otherwise reserves 92%% of RAM)",
    )


def build_engine(args: argparse.Namespace):
    if args.engine == "vllm":
        from agent_r1.rollout.vllm_engine import VLLMEngine

        kwargs = {"dtype": args.dtype or "auto"}
        if args.max_context:
            kwargs["max_model_len"] = args.max_context
        if args.kv_cache_gib:
            kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
        return VLLMEngine(args.model, **kwargs)
    import torch

    from agent_r1.rollout.hf import HFEngine

    return HFEngine.from_pretrained(
        args.model,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        device=args.device,
        max_batch_size=args.max_batch_size,
        max_context=args.max_context,
    )


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from agent_r1.models.loading import load_tokenizer
    from agent_r1.rollout.server import build_app

    if not Path(args.model).is_dir():
        raise SystemExit(f"agent-r1 serve: {args.model!r} is not a model folder")
    tokenizer = load_tokenizer(args.model, require_template=False)
    engine = build_engine(args)
    name = args.served_model_name or Path(args.model).resolve().name
    app = build_app(engine, model_name=name, tokenizer=tokenizer)
    print(f"agent-r1 serve: {name} ({args.engine}) on http://{args.host}:{args.port}/v1", flush=True)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None)
    return 0
