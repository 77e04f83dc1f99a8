"""Loading Hugging Face tokenizers and models, with the checks that save users an hour."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = [
    "ModelFolder",
    "ModelNotFoundError",
    "adapter_folder_problem",
    "NoChatTemplateError",
    "enable_checkpointing",
    "go_offline",
    "hub_reachable",
    "in_hub_cache",
    "load_frozen_model",
    "load_tokenizer",
    "model_folder",
    "model_not_found_as_error",
    "quiet_peft_warnings",
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


@contextmanager
def quiet_peft_warnings() -> Iterator[None]:
    """Without the FutureWarning peft triggers on every load by reading transformers' deprecated
    ``is_gradient_checkpointing`` alias: the warning is theirs, printed on every run."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)
        yield


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
    adapter: str | Path | None = None,
):
    """A causal LM from ``path`` that only samples or scores: eval mode, no parameter needs a gradient
    (an engine's own copy, the reference policy, a teacher). ``dtype``: a torch dtype name, or
    ``"auto"`` (the checkpoint's). A folder holding a saved LoRA adapter is that adapter on its base
    (``model_folder``), merged into the weights; so is ``adapter`` (an adapter folder) on the model
    at ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = model_folder(path, key)
    adapter = adapter or folder.adapter
    kernel = {"attn_implementation": attn_implementation} if attn_implementation else {}
    with model_not_found_as_error(folder.base, key), quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(
            folder.base, dtype=dtype if dtype == "auto" else getattr(torch, dtype), **kernel
        )
    if adapter is not None:
        from peft import PeftModel

        with quiet_peft_warnings():
            model = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ModelFolder:
    """What a model folder (or Hub name) holds, the one meaning that train, eval, serve and check
    give it: a full model (``adapter`` None, ``base`` the folder itself), or a LoRA adapter that peft
    saved (``adapter_config.json`` and its weights, no ``config.json``) on the base model its
    ``adapter_config.json`` names (``base``). ``lora``: that adapter's saved settings."""

    path: str
    base: str
    adapter: str | None = None
    lora: dict | None = None

    @property
    def has_tokenizer(self) -> bool:
        """Whether the adapter folder holds a tokenizer of its own (``save_model`` writes one)."""
        return self.adapter is not None and (Path(self.adapter) / "tokenizer_config.json").is_file()

    @property
    def tokenizer(self) -> str:
        """Where its tokenizer loads from: the adapter folder when it holds one, else the base."""
        return self.adapter if self.has_tokenizer else self.base

    def describe(self) -> str:
        if self.adapter is None:
            return f"{self.path!r}: a full model" if Path(self.path).is_dir() else f"{self.path!r}"
        return f"{self.adapter!r}: {describe_lora(self.lora or {})}, on the base model {self.base!r}"


def describe_lora(saved: Mapping) -> str:
    """One line of a saved adapter's settings (its ``adapter_config.json``)."""
    targets = saved.get("target_modules")
    targets = ", ".join(sorted(targets)) if isinstance(targets, (list, tuple)) else targets
    alpha = saved.get("lora_alpha")
    return (
        f"a LoRA adapter of rank {saved.get('r')}, alpha {alpha:g}, on {targets}"
        if isinstance(alpha, (int, float))
        else f"a LoRA adapter of rank {saved.get('r')}, on {targets}"
    )


def adapter_folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is no plain LoRA adapter that peft saved, or None when it is one."""
    if not folder.is_dir():
        return (
            f"{str(folder)!r} is not a folder (a relative path is taken from the working directory, "
            f"{Path.cwd()}, else from the config file's folder)"
        )
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        inside = sorted(p.parent.name for p in folder.glob("*/adapter_config.json"))
        hint = (
            f": give one of its subfolders {inside} (peft saves an adapter not named 'default' in a "
            "subfolder of its name)"
            if inside
            else ""
        )
        return f"{str(folder)!r} holds no adapter_config.json, so it is no adapter peft saved{hint}"
    try:
        saved = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        return f"{config_file} cannot be read: {error}"
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        kind = saved.get("peft_type") if isinstance(saved, dict) else None
        return f"{str(folder)!r} holds a {kind} adapter; a policy is a LoRA adapter"
    if saved.get("use_dora"):
        return f"{str(folder)!r} holds a DoRA adapter; the engines mix plain LoRA adapters in one batch only"
    if not any((folder / f).is_file() for f in ADAPTER_WEIGHTS):
        return f"{str(folder)!r} holds no adapter weights (adapter_model.safetensors)"
    return None


def model_folder(path: str | Path, key: str | None = "model.path") -> ModelFolder:
    """What ``path`` holds (``ModelFolder``). A folder with ``adapter_config.json`` and no
    ``config.json`` is a saved LoRA adapter: checked (``adapter_folder_problem``), and its base is
    the ``base_model_name_or_path`` of its ``adapter_config.json``, found as written (absolute, or
    from the working directory), else beside the adapter folder, else taken as a Hugging Face Hub
    name. Anything else (a model folder, a Hub name, a path that does not exist) is a full model;
    whether it loads is for the loader to say. ``key`` names the config key in errors."""
    given, path = str(path), Path(path).expanduser()
    if not (path / "adapter_config.json").is_file() or (path / "config.json").is_file():
        return ModelFolder(given, given)
    where = _named(given, key)
    problem = adapter_folder_problem(path)
    if problem is not None:
        raise ModelNotFoundError(f"{where}: {problem}")
    saved = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
    named = saved.get("base_model_name_or_path")
    if not named:
        raise ModelNotFoundError(
            f"{where} is a LoRA adapter whose adapter_config.json names no base model "
            "(base_model_name_or_path): give the base model's folder as model.path and this adapter "
            "as model.adapter"
        )
    base = Path(named).expanduser()
    candidates = [base] if base.is_absolute() else [base, path.parent / base]
    found = next((c for c in candidates if (c / "config.json").is_file()), None)
    if found is not None:
        return ModelFolder(given, str(found.resolve()), str(path.resolve()), saved)
    if base.is_absolute() or any(c.exists() for c in candidates):
        raise ModelNotFoundError(
            f"{where} is a LoRA adapter on the base model {named!r} (its adapter_config.json's "
            "base_model_name_or_path), which holds no model here: give the base model's folder as "
            "model.path and this adapter as model.adapter"
        )
    return ModelFolder(given, str(named), str(path.resolve()), saved)  # a Hub name
