"""Loading Hugging Face tokenizers and models, with the checks that save users an hour."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["load_tokenizer", "require_chat_template"]


def load_tokenizer(name_or_path: str | Path, *, require_template: bool = True) -> PreTrainedTokenizerBase:
    """Load a tokenizer; honour a saved ``PreTrainedTokenizerFast`` class exactly.

    ``AutoTokenizer`` picks the tokenizer class from ``config.json``'s model type when one is present,
    which silently swaps a custom tokenizer saved next to a Qwen2 model for Qwen's own pre-tokeniser.
    A folder whose ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` is loaded as exactly that.
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
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if require_template:
        require_chat_template(tokenizer, str(name_or_path))
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def require_chat_template(tokenizer: PreTrainedTokenizerBase, where: str = "the tokenizer") -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where} has no chat template: agent-r1 renders conversations with the tokenizer's chat "
            "template. Use an instruct/chat model, or set `tokenizer.chat_template` (a Jinja string) "
            "before building the environment."
        )
