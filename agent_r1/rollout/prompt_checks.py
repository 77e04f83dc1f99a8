"""The prompt checks every in-process engine runs before it queues a request.

A prompt that no model can run (empty, a token id outside the vocabulary, no room left in the
context) fails alone, as a ``Completion`` that says why, instead of failing the batch it would join.
``HFEngine`` and ``VLLMEngine`` both ask ``refuse_prompt``, so they refuse the same prompts with the
same words.
"""

from __future__ import annotations

from collections.abc import Sequence

from agent_r1.types import Completion, StopReason

__all__ = ["refuse_prompt"]


def refuse_prompt(prompt_ids: Sequence[int], *, vocab_size: int, max_context: int) -> Completion | None:
    """The ``Completion`` that refuses ``prompt_ids`` (``ABORT``, or ``LENGTH`` when the prompt fills
    the context), or None when a model of ``vocab_size`` tokens and ``max_context`` positions can
    run it."""
    if not prompt_ids:
        return Completion((), (), StopReason.ABORT, error="empty prompt: nothing to condition on")
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        return Completion(
            (),
            (),
            StopReason.ABORT,
            error=f"prompt has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}",
        )
    if len(prompt_ids) >= max_context:
        return Completion(
            (),
            (),
            StopReason.LENGTH,
            error=f"prompt has {len(prompt_ids)} tokens; the model's context is {max_context}",
        )
    return None
