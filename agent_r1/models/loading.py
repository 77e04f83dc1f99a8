"""Loading Hugging Face tokenizers and models, with the checks that save users an hour."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "ModelNotFoundError",
    "NoChatTemplateError",
    "enable_checkpointing",
    "go_offline",
    "hub_reachable",
    "in_hub_cache",
    "load_frozen_model",
    "load_tokenizer",
    "model_not_found_as_error",
    "quiet_progress_bars",
    "require_chat_template",
    "save_model",
]


@contextmanager
def quiet_progress_bars() -> Iterator[None]:
    """No transformers / huggingface_hub progress bars inside (the "Loading weights" and "Writing
    model shards" bars that every load and save draws, clutter on every run); restored after. The
    switch is process-wide while inside. Warnings and errors are logged as usual: only the bars are
    off. A user who disabled the bars keeps them off."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    if was_enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def enable_checkpointing(model) -> None:
    """Recompute activations in the backward pass, non-reentrant; by transformers 5's name for it
    where it has one (the old one warns on every run), else by the old one."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def save_model(model, tokenizer: PreTrainedTokenizerBase | None, path: str | Path) -> Path:
    """``model`` (and ``tokenizer``) saved to ``path`` as a Hugging Face folder, without progress bars."""
    path = Path(path)
    with quiet_progress_bars():
        model.save_pretrained(path)
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    return path


class ModelNotFoundError(FileNotFoundError):
    """A model name or path that is neither a local folder nor loadable from the Hugging Face Hub."""


class NoChatTemplateError(ValueError):
    """A tokenizer without the chat template that agent-r1 renders conversations with."""


def _named(name_or_path: str | Path, key: str | None) -> str:
    return f"{key} = {str(name_or_path)!r}" if key else repr(str(name_or_path))


@contextmanager
def model_not_found_as_error(name_or_path: str | Path, key: str | None = None) -> Iterator[None]:
    """Turn the hub client's error for a missing model (``OSError: Repo id must be in the form ...``
    for a path that does not exist, a connection error offline) into one ``ModelNotFoundError`` naming
    the config ``key`` and the value. Errors about a local folder that does exist pass unchanged."""
    try:
        yield
    except OSError as error:
        if Path(name_or_path).exists():
            raise
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelNotFoundError(
            f"{_named(name_or_path, key)} is not a local folder, and no model of that name could be "
            "loaded from the Hugging Face Hub or its local cache (without network access a hub model "
            f"must be downloaded beforehand; or give the path of a local folder). Hub: {reason}"
        ) from None


def hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the Hugging Face Hub's endpoint accepts a connection within ``timeout_s`` (one try, no
    retries: the hub client itself retries a dead network for about a minute). False in offline
    mode (``HF_HUB_OFFLINE``)."""
    import socket
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return False
    url = urlsplit(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def go_offline() -> None:
    """Offline mode for the rest of this process (``HF_HUB_OFFLINE=1``): models and datasets come
    from the local cache, and no request is retried against an unreachable Hub."""
    import os

    from huggingface_hub import constants

    os.environ["HF_HUB_OFFLINE"] = "1"
    constants.HF_HUB_OFFLINE = True


def in_hub_cache(name: str) -> bool:
    """Whether the local Hugging Face cache holds the model (or tokenizer) ``name``."""
    from huggingface_hub import try_to_load_from_cache

    try:
        return any(
            isinstance(try_to_load_from_cache(name, file), str)
            for file in ("config.json", "tokenizer_config.json")
        )
    except ValueError:  # not a valid repo id
        return False


def load_tokenizer(
    name_or_path: str | Path, *, require_template: bool = True, key: str | None = None
) -> PreTrainedTokenizerBase:
    """Load a tokenizer; honour a saved ``PreTrainedTokenizerFast`` class exactly.

    ``AutoTokenizer`` picks the tokenizer class from ``config.json``'s model type when one is present,
    which silently swaps a custom tokenizer saved next to a Qwen2 model for Qwen's own pre-tokeniser.
    A folder whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` is loaded as exactly that.
    ``key`` (e.g. ``"model.path"``) names the config key the value came from in error messages.
    """
    path = Path(name_or_path)
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
        saved_class = json.loads(config_file.read_text()).get("tokenizer_class")
        if saved_class in ("PreTrainedTokenizerFast", "TokenizersBackend"):
            tokenizer = PreTrainedTokenizerFast.from_pretrained(path)
        else:
            tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        with model_not_found_as_error(name_or_path, key):
            tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if require_template:
        require_chat_template(tokenizer, _named(name_or_path, key))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def require_chat_template(tokenizer: PreTrainedTokenizerBase, where: str = "the tokenizer") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            f"{where} has no chat template: agent-r1 renders conversations with the tokenizer's chat "
            "template. Use an instruct/chat model, or set `tokenizer.chat_template` (a Jinja string) "
            "before building the environment."
        )


def load_frozen_model(
    path: str | Path,
    *,
    dtype: str = "float32",
    attn_implementation: str | None = None,
    key: str | None = "model.path",
):
    """A causal LM from ``path`` that only samples or scores: eval mode, no parameter needs a gradient
    (an engine's own copy, the reference policy). ``dtype``: a torch dtype name, or ``"auto"`` (the
    checkpoint's)."""
    import torch
    from transformers import AutoModelForCausalLM

    kernel = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with model_not_found_as_error(path, key), quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype if dtype == "auto" else getattr(torch, dtype), **kernel
        )
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
