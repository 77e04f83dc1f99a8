"""A tiny, local, download-free model: a byte-level tokenizer with a ChatML chat template and a
small Qwen2-architecture causal LM built from config.

Used by the embedded default (``agent-r1 quickstart``), the examples and the tests. Everything is
written to a folder and loaded back with ``from_pretrained`` like any Hugging Face checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from agent_r1.models.chat_templates import QWEN25_CHATML_TOOLS

__all__ = ["SPECIAL_TOKENS", "build_tiny_model", "build_tiny_tokenizer", "save_tiny_checkpoint"]

# Special tokens are single ids; <|im_end|> doubles as end of sequence, as in Qwen2.5.
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
)


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) plus ChatML special tokens.

    Every string round-trips exactly through encode/decode, which keeps the tests honest about
    token-in/token-out.
    """
    byte_alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(byte_alphabet))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], ignore_merges=True))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS[1:])})
    tokenizer.chat_template = QWEN25_CHATML_TOOLS
    return tokenizer


def build_tiny_model(
    vocab_size: int,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 384,
    max_position_embeddings: int = 2048,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    seed: int = 0,
) -> Qwen2ForCausalLM:
    """A ~1M-parameter Qwen2 causal LM with random weights (seeded)."""
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_tiny_checkpoint(path: str | Path, *, seed: int = 0, **model_kwargs) -> Path:
    """Build the tiny tokenizer and model and save both to ``path`` (a Hugging Face folder)."""
    path = Path(path)
    tokenizer = build_tiny_tokenizer()
    model = build_tiny_model(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
        **model_kwargs,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
