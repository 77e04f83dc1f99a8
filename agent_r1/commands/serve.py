"""``agent-r1 serve MODEL``: serve a model folder over HTTP with the OpenAI API.

``/v1/completions`` (token-id or text prompts; token ids and log-probs back), ``/v1/chat/completions``
(the tokenizer's chat template), ``/v1/responses`` (OpenAI Responses) and ``/v1/messages`` (Anthropic
Messages), ``/v1/models`` and ``/health``; see ``agent_r1.rollout.server``. Tool calls are parsed with
``--tool-format`` in all three chat APIs (chat completions when the request has ``tools``), and
``--tool-prompt`` says how a request's tools reach the prompt (as the agent gateway's ``tool_prompt``:
a model warm-started under ``compact`` is served the prompts it learned on).
The HF engine runs anywhere; ``--engine vllm`` needs the ``vllm`` package (``.venv-vllm``).

``--api-key KEY`` (or ``AGENT_R1_API_KEY``) makes every request but ``/health`` need
``Authorization: Bearer KEY`` (or ``x-api-key: KEY``, as Anthropic's clients send it). An address other than loopback is refused without a key unless
``--allow-unauthenticated`` says the network is trusted: a served model is compute that anyone who
can reach the port could spend.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

API_KEY_ENV = "AGENT_R1_API_KEY"

HELP = "Serve a model over HTTP with the OpenAI completions / chat API (token ids and log-probs)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="a Hugging Face model folder (weights + tokenizer)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--api-key",
        default=None,
        help=f"require 'Authorization: Bearer KEY' on every request but /health (default: ${API_KEY_ENV}; "
        "prefer the variable: a command line is visible to every user of the machine)",
    )
    parser.add_argument(
        "--allow-unauthenticated",
        action="store_true",
        help="serve a non-loopback --host without an API key (only on a network you trust)",
    )
    parser.add_argument(
        "--tool-format",
        default="hermes",
        help="how the model writes tool calls, parsed in /v1/chat/completions answers to requests with "
        "tools and in /v1/responses and /v1/messages answers (hermes, llama3_json; default: %(default)s)",
    )
    parser.add_argument(
        "--tool-prompt",
        choices=("template", "compact", "none"),
        default="template",
        help="how a request's tools reach the prompt, as the agent gateway's tool_prompt: template (the "
        "chat template's JSON schemas), compact (one line per tool in the system message), none "
        "(default: %(default)s)",
    )
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


def build_engine(args: argparse.Namespace, tokenizer):
    """The engine the arguments ask for, from the one engine factory (``agent_r1.rollout.factory``)."""
    from agent_r1.rollout.factory import EngineUnavailable
    from agent_r1.rollout.factory import build_engine as build

    if args.engine == "vllm":
        kwargs = {}
        if args.max_context:
            kwargs["max_model_len"] = args.max_context
        if args.kv_cache_gib:
            kwargs["kv_cache_memory_bytes"] = int(args.kv_cache_gib * 2**30)
    else:
        kwargs = {
            "max_batch_size": args.max_batch_size,
            "device": args.device,
            "max_context": args.max_context,
        }
    try:
        return build(args.engine, args.model, tokenizer=tokenizer, dtype=args.dtype, **kwargs)
    except EngineUnavailable as e:
        raise SystemExit(f"agent-r1 serve: --engine {args.engine}: {e}") from None


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from agent_r1.models.loading import load_tokenizer, model_folder
    from agent_r1.rollout.server import build_app, check_exposure

    # An empty variable counts as unset (as VLLM_API_KEY does); an empty --api-key is an error.
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV) or None
    try:  # before loading anything: a refused start should cost nothing
        check_exposure(args.host, api_key=api_key, allow_unauthenticated=args.allow_unauthenticated)
    except ValueError as e:
        raise SystemExit(f"agent-r1 serve: {e}") from None
    from agent_r1.tools.formats import compact_tools_text, get_format

    try:
        fmt = get_format(args.tool_format)
    except (KeyError, ValueError) as e:
        raise SystemExit(f"agent-r1 serve: --tool-format: {e}") from None
    if args.tool_prompt == "compact":
        try:
            compact_tools_text([], fmt)
        except ValueError as e:
            raise SystemExit(f"agent-r1 serve: --tool-prompt compact: {e}") from None
    if not Path(args.model).is_dir():
        raise SystemExit(f"agent-r1 serve: {args.model!r} is not a model folder")
    # a saved LoRA adapter is served on its base (model_folder), with its own tokenizer or the base's
    tokenizer = load_tokenizer(model_folder(args.model, key=None).tokenizer, require_template=False)
    engine = build_engine(args, tokenizer)
    name = args.served_model_name or Path(args.model).resolve().name
    app = build_app(
        engine,
        model_name=name,
        tokenizer=tokenizer,
        api_key=api_key,
        tool_format=args.tool_format,
        tool_prompt=args.tool_prompt,
    )
    auth = "API key required" if api_key else "no API key"
    print(f"agent-r1 serve: {name} ({args.engine}) on http://{args.host}:{args.port}/v1, {auth}", flush=True)
    # handler_cancellation: a client that disconnects cancels its engine request (see server.py)
    web.run_app(app, host=args.host, port=args.port, print=None, access_log=None, handler_cancellation=True)
    return 0
