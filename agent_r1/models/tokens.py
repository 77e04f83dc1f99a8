"""Text and token ids at the model's boundary: the chat template, exact encoding, observations to
prompt ids and responses to text. Below envs/ and flows/, which both build prompts with it."""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from agent_r1.models.loading import require_chat_template
from agent_r1.types import Completion, Message, Observation

__all__ = ["decode_response", "encode_text", "observation_ids", "render_messages"]


def render_messages(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Message],
    *,
    tools: Sequence[dict] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """The tokenizer's chat template applied to ``messages`` (and tool schemas), as text."""
    require_chat_template(tokenizer)
    return tokenizer.apply_chat_template(
        [dict(m) for m in messages],
        tools=list(tools) if tools else None,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
    )


def encode_text(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    """Token ids of ``text`` exactly as written: special-token text becomes its single id, and no
    BOS/EOS is added (the chat template already wrote them)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


def observation_ids(observation: Observation, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Prompt ids for an observation: token ids as is; messages through the chat template (with the
    generation prompt); text encoded without special tokens added."""
    if observation.token_ids is not None:
        return list(observation.token_ids)
    if observation.messages is not None:
        return encode_text(tokenizer, render_messages(tokenizer, observation.messages))
    return encode_text(tokenizer, observation.text or "")


def decode_response(tokenizer: PreTrainedTokenizerBase, completion: Completion) -> str:
    """The response text, special tokens kept (tool-call tags may be special tokens)."""
    return tokenizer.decode(list(completion.token_ids), skip_special_tokens=False)
