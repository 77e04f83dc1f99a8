"""A tiny, local, download-free model: a byte-level tokenizer with a ChatML chat template and a
small Qwen2-architecture causal LM built from config.

Used by the embedded default (``agent-r1 quickstart``), the examples, the tutorial and the tests:

    from agent_r1.models.tiny import build_tiny

    model, tokenizer = build_tiny(seed=0)          # in memory: Trainer(config, model=model, tokenizer=tokenizer)
    save_tiny_checkpoint("runs/tiny")              # or a Hugging Face folder, for model.path in a config

The model has random weights: it earns no reward on a real task until it is warm-started on
demonstrations (``agent_r1.train.sft``, docs/tutorial.md). ``architecture="qwen3"`` builds a Qwen3
instead (the recipes' smoke runs, ``agent_r1.models.stand_in``).
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from agent_r1.models.chat_templates import QWEN25_CHATML_TOOLS

__all__ = [
    "ARCHITECTURES",
    "SPECIAL_TOKENS",
    "build_tiny",
    "build_tiny_model",
    "build_tiny_tokenizer",
    "save_tiny_checkpoint",
]

ARCHITECTURES = {"qwen2": (Qwen2Config, Qwen2ForCausalLM), "qwen3": (Qwen3Config, Qwen3ForCausalLM)}

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


def build_tiny_tokenizer(
    chat_template: str = QWEN25_CHATML_TOOLS, extra_special_tokens: tuple[str, ...] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (256 byte tokens, no merges) plus ChatML special tokens (and
    ``extra_special_tokens``, e.g. Qwen3's ``<think>``), with ``chat_template`` (Qwen2.5's by default).

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
        additional_special_tokens=[*SPECIAL_TOKENS[1:], *extra_special_tokens],
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens({"additional_special_tokens": [*SPECIAL_TOKENS[1:], *extra_special_tokens]})
    tokenizer.chat_template = chat_template
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
    architecture: str = "qwen2",
) -> PreTrainedModel:
    """A ~1M-parameter causal LM of ``architecture`` (``ARCHITECTURES``: qwen2, qwen3) with random
    weights (seeded)."""
    if architecture not in ARCHITECTURES:
        raise ValueError(f"unknown tiny architecture {architecture!r}; known: {', '.join(ARCHITECTURES)}")
    config_class, model_class = ARCHITECTURES[architecture]
    config = config_class(
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
        # Qwen3 sets its head size apart from hidden_size / num_heads (128 by default): kept tiny.
        **({"head_dim": hidden_size // num_heads} if architecture == "qwen3" else {}),
    )
    torch.manual_seed(seed)
    return model_class(config)


def build_tiny(
    *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **model_kwargs
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """``(model, tokenizer)``: the tiny tokenizer (or ``tokenizer``) and a tiny model sized to it, its
    end-of-sequence and padding ids set from the tokenizer (``<|im_end|>``, ``<|endoftext|>``).
    ``model_kwargs`` go to ``build_tiny_model`` (``hidden_size``, ``num_layers``, ``architecture``...)."""
    tokenizer = tokenizer if tokenizer is not None else build_tiny_tokenizer()
    model = build_tiny_model(
        len(tokenizer),
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        seed=seed,
        **model_kwargs,
    )
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer


def save_tiny_checkpoint(
    path: str | Path, *, seed: int = 0, tokenizer: PreTrainedTokenizerFast | None = None, **model_kwargs
) -> Path:
    """``build_tiny`` saved to ``path`` (a Hugging Face folder: ``model.path`` in a config)."""
    from agent_r1.models.loading import save_model

    model, tokenizer = build_tiny(seed=seed, tokenizer=tokenizer, **model_kwargs)
    return save_model(model, tokenizer, path)
