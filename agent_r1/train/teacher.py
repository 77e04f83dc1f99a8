"""The teacher of on-policy distillation (``algorithm.distill``): who scores the student's tokens.

A teacher gives the log-prob of every sampled response token of a batch, in the batch's flat token
order (``agent_r1.algos.TokenFields.teacher_logprobs``), under its own ``log softmax(logits)``
(temperature 1: the teacher's distribution, whatever the student sampled with):

- a **local** Hugging Face model (``LocalTeacher``), frozen, held by the learner beside the reference
  model (on Ray by every learner worker) and run over the same packed micro-batches and prefix tries
  as the reference: each response token is scored given its step's own prompt and the response
  before it, exactly as in one row per step (a causal model cannot see later tokens of a shared row);
- a **server** (``algorithm.distill.teacher: http://.../v1``): each step's prompt + response sent as
  token ids with vLLM's ``prompt_logprobs`` (``agent_r1.rollout.prompt_logprobs``).

``check_teacher`` runs before any model is loaded: a folder that does not exist, a tokenizer that
differs from the policy's (vocabulary, special tokens, chat template) or a server that returns no
prompt log-probs is one ``ConfigError`` naming ``algorithm.distill.teacher``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from agent_r1.algos import distill_tokens
from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import ConfigError, DistillConfig, TrainConfig
from agent_r1.train.learner import micro_batch_logprobs

if TYPE_CHECKING:
    from agent_r1.train.batch import TrainBatch
    from agent_r1.train.step_context import StepContext

__all__ = [
    "LocalTeacher",
    "check_teacher",
    "distill",
    "is_server",
    "load_teacher",
    "server_teacher_logprobs",
    "tokenizer_differences",
]

KEY = "algorithm.distill.teacher"


def is_server(distill: DistillConfig) -> bool:
    return distill.teacher.startswith(("http://", "https://"))


def _api_key(distill: DistillConfig) -> str | None:
    if distill.api_key_env is None:
        return None
    key = os.environ.get(distill.api_key_env)
    if not key:
        raise ConfigError("algorithm.distill.api_key_env", f"${distill.api_key_env} is not set or empty")
    return key


def tokenizer_differences(student, teacher) -> list[str]:
    """What differs between two tokenizers in ways that change token ids or rendered prompts."""
    differences = []
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    if student_vocab != teacher_vocab:
        differing = sum(1 for token, i in student_vocab.items() if teacher_vocab.get(token) != i)
        differing += sum(1 for token in teacher_vocab if token not in student_vocab)
        differences.append(
            f"vocabulary: {len(student_vocab)} tokens vs the teacher's {len(teacher_vocab)}, "
            f"{differing} mapped differently"
        )
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        if getattr(student, name, None) != getattr(teacher, name, None):
            differences.append(
                f"{name}: {getattr(student, name, None)} vs the teacher's {getattr(teacher, name, None)}"
            )
    if sorted(student.all_special_tokens) != sorted(teacher.all_special_tokens):
        only_student = sorted(set(student.all_special_tokens) - set(teacher.all_special_tokens))
        only_teacher = sorted(set(teacher.all_special_tokens) - set(student.all_special_tokens))
        differences.append(
            f"special tokens: only the policy's {only_student[:5]}, only the teacher's {only_teacher[:5]}"
        )
    if getattr(student, "chat_template", None) != getattr(teacher, "chat_template", None):
        differences.append("chat template")
    return differences


def check_teacher(config: TrainConfig, tokenizer) -> None:
    """Refuse a teacher that cannot score this policy's tokens, before any model is loaded (see the
    module docstring); a no-op without ``algorithm.distill.teacher``."""
    distill = config.algorithm.distill
    if not distill.teacher:
        return
    if is_server(distill):
        _check_server(distill, tokenizer)
        return
    path = Path(distill.teacher)
    if not path.is_dir():
        raise ConfigError(
            KEY,
            f"{distill.teacher!r} is not a folder (a local Hugging Face model, or a server URL http://host:port/v1)",
        )
    if not (path / "config.json").is_file():
        hint = f" (a training checkpoint's model is {path / 'model'})" if (path / "model").is_dir() else ""
        raise ConfigError(
            KEY, f"{distill.teacher!r} holds no config.json: not a Hugging Face model folder{hint}"
        )
    from agent_r1.models.loading import load_tokenizer

    try:
        teacher_tokenizer = load_tokenizer(path, require_template=False)
    except (OSError, ValueError) as error:
        raise ConfigError(KEY, f"cannot load the tokenizer of {distill.teacher!r}: {error}") from None
    differences = tokenizer_differences(tokenizer, teacher_tokenizer)
    if differences:
        raise ConfigError(
            KEY,
            f"{distill.teacher!r} does not share the policy's tokenizer, so it cannot score the policy's "
            f"tokens: {'; '.join(differences)}",
        )


def _check_server(distill: DistillConfig, tokenizer) -> None:
    """A server must answer a two-token probe with prompt log-probs (and list a model, when none is named)."""
    from agent_r1.rollout.prompt_logprobs import PromptLogprobsError, prompt_logprobs, served_model

    api_key = _api_key(distill)
    probe = tokenizer.encode("Hello world", add_special_tokens=False)[:4] or [0, 1]

    async def run() -> None:
        model = distill.teacher_model or await served_model(distill.teacher, api_key=api_key)
        await prompt_logprobs(distill.teacher, model, [probe], api_key=api_key, timeout=60.0)

    try:
        asyncio.run(run())
    except PromptLogprobsError as error:
        raise ConfigError(KEY, f"the teacher server cannot score prompts: {error}") from None


class LocalTeacher:
    """A frozen Hugging Face model that scores micro-batches (the learner's layout)."""

    def __init__(self, model) -> None:
        self.model = model

    @torch.no_grad()
    def logprobs(self, micro_batches: Sequence[MicroBatch], num_tokens: int) -> Tensor:
        """Log-probs (num_tokens,) of the scored tokens of ``micro_batches``, zero elsewhere."""
        out_T = torch.zeros(num_tokens)
        for mb in micro_batches:
            logprobs_K, _ = micro_batch_logprobs(self.model, mb, 1.0)
            out_T[mb.flat_index_K] = logprobs_K.float().cpu()
        return out_T


def load_teacher(config: TrainConfig, learner_device) -> LocalTeacher | None:
    """The local teacher on ``algorithm.distill.device`` ('learner': ``learner_device``), or None (no
    distillation, or a server teacher)."""
    distill = config.algorithm.distill
    if not distill.teacher or is_server(distill):
        return None
    from agent_r1.models.loading import load_frozen_model

    device = learner_device if distill.device == "learner" else torch.device(distill.device)
    model = load_frozen_model(
        distill.teacher,
        dtype=config.model.dtype,
        attn_implementation=config.model.attn_implementation,
        key=KEY,
    )
    return LocalTeacher(model.to(device))


def server_teacher_logprobs(distill: DistillConfig, steps, offsets: Sequence[int], num_tokens: int) -> Tensor:
    """Each step's prompt + response scored by the teacher server; the response tokens' log-probs
    (num_tokens,) in the flat order (step row i's tokens start at ``offsets[i]``)."""
    from agent_r1.rollout.prompt_logprobs import PromptLogprobsError, prompt_logprobs, served_model

    api_key = _api_key(distill)

    async def run() -> list[list[float]]:
        model = distill.teacher_model or await served_model(distill.teacher, api_key=api_key)
        sequences = [list(s.prompt_ids) + list(s.response_ids) for s in steps]
        return await prompt_logprobs(distill.teacher, model, sequences, api_key=api_key)

    try:
        scored = asyncio.run(run())
    except PromptLogprobsError as error:
        raise RuntimeError(f"{KEY}: {error}") from None
    out_T = torch.zeros(num_tokens)
    for step, offset, logprobs in zip(steps, offsets, scored, strict=True):
        n = len(step.response_ids)
        out_T[offset : offset + n] = torch.tensor(logprobs[len(step.prompt_ids) - 1 :], dtype=torch.float32)
    return out_T


def distill(batch: TrainBatch, context: StepContext) -> tuple[TrainBatch, dict[str, float]]:
    """The learning phase ``teacher`` (``algorithm.distill``, on-policy distillation): the teacher's
    log-probs of the sampled tokens (the learner's local teacher over the packed micro-batches, or a
    server scoring each step's prompt + response), and ``-coef`` x the per-token reverse KL against
    the sampler's log-probs (each step's own policy version) added to the advantages
    (``agent_r1.algos.distill``); its metric ``distill/reverse_kl`` is the mean per action token."""
    config = context.config.algorithm.distill
    if not config.teacher:
        return batch, {}
    if is_server(config):
        teacher_T = server_teacher_logprobs(config, batch.rows.steps, batch.rows.offsets, batch.num_tokens)
    else:
        teacher_T = context.learner.teacher_logprobs(batch.all_micro_batches, batch.num_tokens)
    tokens, metrics = distill_tokens(
        batch.tokens, teacher_T, coef=config.coef, reward_weight=config.reward_weight
    )
    return replace(batch, tokens=tokens), metrics
