"""The learner: a Hugging Face causal LM policy, its log-probs on packed micro-batches, and updates.

- Log-probs are ``log softmax(logits / temperature)`` over the full vocabulary, the exact quantity the
  samplers report (``agent_r1.types``); masking logits on one side only would break the PPO ratio.
- A micro-batch is packed rows (``agent_r1.train.batching``) run with ``position_ids`` restarting
  per sequence and no attention mask, which Hugging Face turns into a block-diagonal causal mask; a
  micro-batch holding prefix trees brings its own 4D mask. Under SDPA on the CPU both run segment by
  segment instead (``agent_r1.train.segment_attention``; ``model_inputs``).
- Updates accumulate gradients over micro-batches with *global* per-token weights (see
  ``agent_r1.algos.aggregation``), so the loss of a mini-batch does not depend on how it was cut into
  micro-batches. A non-finite loss or gradient norm skips the optimizer step (counted in the metrics);
  nothing non-finite ever reaches the weights.
- LoRA through peft: the reference policy is the same model with the adapter disabled.
- Mixed precision (``compute_dtype``, ``agent_r1.models.precision``): the forward passes run under
  autocast, the parameters, gradients and AdamW's state stay in the model's dtype, and log-probs,
  entropies and losses stay fp32; a float16 update is loss-scaled.
- The model stays in eval mode (dropout off) except during an update with gradient checkpointing
  (which Hugging Face only applies in train mode); RL practice trains with dropout 0 so that the
  learner's distribution is the sampler's.
- Data parallelism plugs in through ONE extension point, ``GradientSync`` (the single-process default
  does nothing): it picks the module the update runs forward/backward on (a DDP or FSDP2 wrapper), how
  many passes every rank runs (collectives need equal counts; a rank short of micro-batches runs
  zero-weight padding passes), suspends gradient reduction for all but the last backward, and sums
  the loss, the finite flag and the statistics over the ranks after accumulation, before clipping,
  and reads and loads the full state a checkpoint holds (rank 0 gathers sharded weights)
  (``agent_r1.distributed.strategy``).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from agent_r1.algos.tokens import TokenFields
from agent_r1.models import precision
from agent_r1.train import segment_attention
from agent_r1.train.batching import MicroBatch
from agent_r1.train.config import ModelConfig, TrainerConfig
from agent_r1.train.lm_head import scored_logprobs

__all__ = [
    "Learner",
    "Forward",
    "GradientSync",
    "MiniBatch",
    "TokenLoss",
    "load_policy",
    "attention_implementation",
    "micro_batch_logprobs",
    "full_logits_logprobs",
    "model_inputs",
    "lr_lambda",
]

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_LOSS, _WEIGHT, _NON_FINITE = "_loss_sum", "_stat_weight", "_non_finite"  # reduced with the stat sums
MASKABLE_KERNELS = ("sdpa", "eager")
"""Attention kernels that accept an arbitrary 4D mask, i.e. can run prefix trees."""


def load_policy(config: ModelConfig, *, path: str | None = None, adapters: Sequence[str] = ()):
    """Load the policy from ``config.path`` (or ``path``) with ``config.attn_implementation``, apply LoRA
    and gradient checkpointing (on the CPU: the caller moves it to ``model.device``). ``adapters``:
    the names of several LoRA adapters (one per trained policy, ``agent_r1.train.policies``), the
    first active; default one adapter, peft's ``default``.

    A saved LoRA adapter (``config.adapter``, or the folder itself when it holds one:
    ``agent_r1.models.loading.model_folder``) is where every adapter starts, trainable, with its own
    saved rank and target modules; otherwise the adapters are fresh, with ``config.lora``'s."""
    from transformers import AutoModelForCausalLM

    from agent_r1.models.loading import (
        enable_checkpointing,
        model_folder,
        model_not_found_as_error,
        quiet_peft_warnings,
        quiet_progress_bars,
    )

    key = "model.path" if path is None else None
    folder = model_folder(path or config.path, key)
    start = folder.adapter or (config.adapter if path is None else None)
    kernel = {"attn_implementation": config.attn_implementation} if config.attn_implementation else {}
    with model_not_found_as_error(folder.base, key), quiet_progress_bars():
        model = AutoModelForCausalLM.from_pretrained(folder.base, dtype=DTYPES[config.dtype], **kernel)
    lora = config.lora.rank > 0 or start is not None
    if lora:
        from peft import LoraConfig, PeftModel, get_peft_model

        with quiet_peft_warnings():
            first, *others = adapters or ("default",)
            if start is not None:
                model = PeftModel.from_pretrained(model, start, adapter_name=first, is_trainable=True)
                for name in others:
                    model.load_adapter(start, adapter_name=name, is_trainable=True)
            else:
                fresh = LoraConfig(
                    r=config.lora.rank,
                    lora_alpha=config.lora.alpha,
                    lora_dropout=config.lora.dropout,
                    target_modules=list(config.lora.target_modules),
                    task_type="CAUSAL_LM",
                )
                model = get_peft_model(model, fresh, adapter_name=first)
                for name in others:
                    model.add_adapter(name, fresh)
            model.set_adapter(first)
    if config.gradient_checkpointing:
        enable_checkpointing(model)
        if lora:
            model.enable_input_require_grads()
    model.eval()
    return model


def attention_implementation(model) -> str:
    """The attention kernel a (possibly DDP- or peft-wrapped) Hugging Face model runs."""
    config = getattr(getattr(model, "module", model), "config", None)
    return getattr(config, "_attn_implementation", None) or "sdpa"


def model_inputs(model, micro_batch: MicroBatch) -> dict[str, Tensor]:
    """The keyword inputs of a Hugging Face forward over ``micro_batch`` on ``model``'s device.

    Under SDPA on the CPU the micro-batch's attention runs segment by segment (``segment_attention``: each
    sequence, or each prefix-tree member's own tokens over what it shares), passed as the
    ``segment_attention`` keyword that Hugging Face hands to the attention function; the placeholder
    4D mask only stops Hugging Face from building a mask nobody reads. Otherwise, without a tree,
    packed sequences are masked by Hugging Face from the restarting position ids, and a prefix-tree
    mask goes in as a 4D mask, which Hugging Face passes to the kernel as given (additive, 0 or the
    dtype's minimum, for the eager kernel). Kernels that take no custom mask (flash-attention) cannot
    run trees (``Trainer`` then builds none).
    """
    parameter = next(model.parameters())
    inputs = {
        "input_ids": micro_batch.input_ids_BT.to(parameter.device),
        "position_ids": micro_batch.position_ids_BT.to(parameter.device),
        "use_cache": False,  # a cache disables Hugging Face's packed-sequence masking
    }
    kernel = attention_implementation(model)
    if micro_batch.segments is not None and segment_attention.applies(kernel, parameter.device):
        segment_attention.install()
        inputs["segment_attention"] = micro_batch.segments.to(parameter.device)
        inputs["attention_mask"] = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=parameter.device)
    elif micro_batch.attention_BTT is not None:
        if kernel not in MASKABLE_KERNELS:
            raise ValueError(
                f"attention kernel {kernel!r} takes no custom mask, so it cannot run prefix trees: "
                "set trainer.share_prefixes: false"
            )
        mask_B1TT = micro_batch.attention_BTT[:, None].to(parameter.device)
        if kernel == "eager":
            blocked = torch.finfo(parameter.dtype).min
            mask_B1TT = torch.zeros(
                mask_B1TT.shape, dtype=parameter.dtype, device=parameter.device
            ).masked_fill(~mask_B1TT, blocked)
        inputs["attention_mask"] = mask_B1TT
    return inputs


def micro_batch_logprobs(
    model, micro_batch: MicroBatch, temperature: float, *, with_entropy: bool = False
) -> tuple[Tensor, Tensor | None]:
    """Log-probs (K,) of the micro-batch's scored tokens, and optionally the entropy (K,) of each
    token's distribution, both under ``softmax(logits / temperature)`` in fp32. The LM head runs at
    the scored positions only, in chunks (``agent_r1.train.lm_head``), where the model allows it."""
    device = next(model.parameters()).device
    inputs = model_inputs(model, micro_batch)
    logit_index_K = micro_batch.logit_index_K.to(device)
    target_ids_K = micro_batch.target_ids_K.to(device)
    scored = scored_logprobs(
        model, inputs, logit_index_K, target_ids_K, temperature, with_entropy=with_entropy
    )
    if scored is not None:
        return scored
    return full_logits_logprobs(model, inputs, logit_index_K, target_ids_K, temperature, with_entropy)


def full_logits_logprobs(
    model,
    inputs: dict[str, Tensor],
    logit_index_K: Tensor,
    target_ids_K: Tensor,
    temperature: float,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """``micro_batch_logprobs`` from the logits of every position (models whose head or logits
    ``agent_r1.train.lm_head`` cannot take over; the reference the chunked path is tested against)."""
    out = model(**inputs)
    logits_KV = out.logits.flatten(0, 1)[logit_index_K].float() / temperature
    logprobs_KV = torch.log_softmax(logits_KV, dim=-1)
    logprobs_K = logprobs_KV.gather(-1, target_ids_K[:, None])[:, 0]
    entropy_K = None
    if with_entropy:
        entropy_K = -(logprobs_KV.exp() * logprobs_KV).sum(-1)
    return logprobs_K, entropy_K


Forward = Callable[..., tuple[Tensor, Tensor | None]]
"""``(model, micro_batch, temperature, *, with_entropy=False) -> (outputs_K, entropy_K | None)``: the
per-token outputs a learner trains (log-probs for the policy, ``micro_batch_values`` for a critic)."""

TokenLoss = Callable[[Tensor, Tensor | None, TokenFields], tuple[Tensor, dict[str, float]]]
"""``(logprobs_K, entropy_K, tokens) -> (loss_K, stats)``: the per-token loss of a micro-batch's tokens,
given their new log-probs, entropies (or None) and the batch's per-token fields gathered to them
(``tokens.advantages``, ``tokens.old_logprobs``...: ``agent_r1.algos.TokenFields``). ``stats`` holds scalars averaged over the
micro-batch's tokens (e.g. the clip fraction); the update reports their token-weighted mean."""


@dataclass(frozen=True)
class MiniBatch:
    """One optimizer step's data: micro-batches, aggregation weights and per-token fields (flat)."""

    micro_batches: Sequence[MicroBatch]
    weights: Tensor  # (num_tokens,) global aggregation weights, 0 on tokens outside this mini-batch
    tokens: TokenFields  # (num_tokens,) each, in the batch's flat token order


MAX_PREFIX = "max:"
"""A stat a learner combines by its maximum (over micro-batches and ranks), not by its sum."""


def combine(per_rank: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Ranks' stat totals in one: summed, but a ``MAX_PREFIX`` key's maximum."""
    out: dict[str, float] = {}
    for sums in per_rank:
        for name, value in sums.items():
            if name in out and name.startswith(MAX_PREFIX):
                out[name] = max(out[name], value)
            else:
                out[name] = out.get(name, 0.0) + value
    return out


class GradientSync:
    """How ``Learner`` shares an update with other data-parallel ranks; this default shares nothing.

    Contract for a data-parallel subclass (``agent_r1.distributed.strategy``): every rank runs
    ``Learner.update`` on its own shard of a mini-batch, weighted by the mini-batch's *global*
    aggregation weights, so that the SUM over ranks of their gradients (and losses) is the
    single-process one; every rank must then take the same optimizer step.
    """

    stops_early = True
    """Whether an update may stop at the first non-finite loss (a rank in a group may not: the others
    wait in collectives for its remaining passes)."""

    def training_module(self, model):
        """The module the update's forward and backward passes run on (e.g. a DDP wrapper)."""
        return model

    def num_passes(self, local: int, *, backward: bool) -> int:
        """How many forward (and, with ``backward``, backward) passes this rank runs, given that it has
        ``local`` micro-batches; the passes past ``local`` are zero-weight padding."""
        return local

    def accumulating(self, module) -> contextlib.AbstractContextManager:
        """Entered around every backward but the last: gradients accumulate locally."""
        return contextlib.nullcontext()

    def reduce(self, sums: dict[str, float]) -> dict[str, float]:
        """Called after accumulation, before clipping: the totals summed over ranks (keys may differ
        between ranks; a missing key counts 0), but a key starting with ``MAX_PREFIX``: its maximum
        over the ranks that have it (``combine``)."""
        return sums

    def grad_norm(self, parameters: Sequence[torch.nn.Parameter], max_norm: float) -> float:
        """Clip the (already reduced) gradients to ``max_norm``; return the norm before clipping."""
        return float(torch.nn.utils.clip_grad_norm_(parameters, max_norm))

    def full_state(self, learner: Learner, *, optimizer: bool) -> tuple[Any, dict | None]:
        """(a module with ``learner``'s full weights, its full optimizer state if asked) where the
        checkpoint is written, (None, None) on the other ranks. Collective: every rank calls it."""
        return learner.model, learner.optimizer.state_dict() if optimizer else None

    def load_checkpoint(self, path, learner: Learner, *, verify: bool = True) -> dict:
        """Load checkpoint ``path`` (``agent_r1.train.checkpoint.load_checkpoint``) into ``learner``;
        return the trainer state. Collective: every rank calls it."""
        from agent_r1.train.checkpoint import load_checkpoint

        own_models = getattr(learner, "own_models", None)  # several policies: agent_r1.train.policies
        learner_state, trainer_state = load_checkpoint(
            path, learner.model, verify=verify, own_models=own_models
        )
        learner.load_state_dict(learner_state)
        return trainer_state

    def load_state(self, learner: Learner, weights: dict, learner_state: dict) -> None:
        """Load full weights and learner state (as ``full_state`` gave them), held by every rank."""
        learner.model.load_state_dict(weights)
        learner.load_state_dict(learner_state)


def _padding_micro_batch() -> MicroBatch:
    """One token at position 0 scoring token 0: the input of a zero-weight padding pass."""
    zeros = torch.zeros(1, 1, dtype=torch.long)
    index = torch.zeros(1, dtype=torch.long)
    return MicroBatch(zeros, zeros, index, index, index)


def lr_lambda(config: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    """Linear warmup over ``warmup_steps``, then constant or cosine decay to ``min_lr_ratio``."""

    def factor(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / (config.warmup_steps + 1)
        if config.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (step - config.warmup_steps) / max(1, total_steps - config.warmup_steps))
        return config.min_lr_ratio + (1 - config.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Learner:
    """Owns a model's optimizer and schedule; computes its per-token outputs and applies updates.

    ``reference``: a frozen reference model, or None (with LoRA the reference is the adapter-disabled
    policy and needs no second model). ``parameters``: what the optimizer trains (default every
    parameter that requires a gradient; one policy's adapter, ``agent_r1.train.policies``). ``forward``: what the model computes per scored token,
    ``micro_batch_logprobs`` (the policy, default) or ``agent_r1.train.critic.micro_batch_values``
    (a critic; ``logprobs`` then returns values and the token loss receives them). ``compute_dtype``:
    what the forward passes compute in, when narrower than the parameters (``precision.autocast``;
    float16 with a ``precision.grad_scaler``); None: the parameters' dtype.
    """

    def __init__(
        self,
        model,
        config: TrainerConfig,
        *,
        temperature: float,
        total_optimizer_steps: int,
        reference=None,
        forward: Forward | None = None,
        sync: GradientSync | None = None,
        parameters: Sequence[torch.nn.Parameter] | None = None,
        compute_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.compute_dtype = compute_dtype
        self.grad_scaler = precision.grad_scaler(model, compute_dtype)
        self.forward = forward or micro_batch_logprobs
        self.sync = sync or GradientSync()
        self.config = config
        self.temperature = temperature
        self.reference = reference
        self.is_lora = hasattr(model, "disable_adapter") and hasattr(model, "peft_config")
        params = (
            list(parameters) if parameters is not None else [p for p in model.parameters() if p.requires_grad]
        )
        self.optimizer = torch.optim.AdamW(
            params, lr=config.lr, betas=tuple(config.betas), weight_decay=config.weight_decay
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lr_lambda(config, total_optimizer_steps)
        )
        self.optimizer_steps = 0
        self.skipped_updates = 0
        # Hugging Face marks checkpointed layers with ``gradient_checkpointing = True``.
        self.gradient_checkpointing = any(
            getattr(m, "gradient_checkpointing", False) for m in model.modules()
        )

    @property
    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    @torch.no_grad()
    def logprobs(
        self, micro_batches: Sequence[MicroBatch], num_tokens: int, *, reference: bool = False
    ) -> Tensor:
        """Log-probs (num_tokens,) of every scored token, in the flat token order (no gradient)."""
        out_K = torch.zeros(num_tokens)
        if reference and self.reference is None and not self.is_lora:
            raise ValueError("no reference model: pass one to the Learner or use LoRA")
        model = self.reference if reference and self.reference is not None else self.model
        adapter_off = self.model.disable_adapter() if reference and self.reference is None else None
        passes = self.sync.num_passes(len(micro_batches), backward=False)
        with adapter_off or contextlib.nullcontext(), precision.autocast(model, self.compute_dtype):
            for index in range(passes):
                if index >= len(micro_batches):
                    self.forward(model, _padding_micro_batch(), self.temperature)
                    continue
                mb = micro_batches[index]
                logprobs_K, _ = self.forward(model, mb, self.temperature)
                out_K[mb.flat_index_K] = logprobs_K.float().cpu()
        return out_K

    def update(
        self, mini_batch: MiniBatch, token_loss: TokenLoss, *, with_entropy: bool = False
    ) -> dict[str, float]:
        """One optimizer step over ``mini_batch``; returns loss, grad norm, lr and token-loss stats."""
        device = next(self.model.parameters()).device
        module = self.sync.training_module(self.model)
        self.optimizer.zero_grad(set_to_none=True)
        if self.gradient_checkpointing:
            self.model.train()
        weighted = [
            mb for mb in mini_batch.micro_batches if bool((mini_batch.weights[mb.flat_index_K] != 0).any())
        ]
        # A micro-batch whose loss is provably zero (``vanishes_at``: every advantage zero and no other
        # term) is not forwarded: its gradient would be exactly zero.
        vanishes_at = getattr(token_loss, "vanishes_at", None)
        active = [
            mb
            for mb in weighted
            if vanishes_at is None or not vanishes_at(mini_batch.tokens, mb.flat_index_K, mini_batch.weights)
        ]
        passes = self.sync.num_passes(len(active), backward=True)
        total_loss = 0.0
        stat_sums: dict[str, float] = {}
        stat_weight = 0.0
        finite = True
        forward_s = backward_s = 0.0
        try:
            for index in range(passes):
                last = index == passes - 1
                with contextlib.nullcontext() if last else self.sync.accumulating(module):
                    if index >= len(active):
                        with precision.autocast(module, self.compute_dtype):
                            outputs_K, _ = self.forward(module, _padding_micro_batch(), self.temperature)
                        (0.0 * outputs_K.sum()).backward()
                        continue
                    mb = active[index]
                    start = time.perf_counter()
                    weights_K = mini_batch.weights[mb.flat_index_K].to(device)
                    # autocast covers the forward only: the loss is fp32, and each op's backward
                    # runs in its forward's dtype without it
                    with precision.autocast(module, self.compute_dtype):
                        logprobs_K, entropy_K = self.forward(
                            module, mb, self.temperature, with_entropy=with_entropy
                        )
                    tokens = mini_batch.tokens.gather(mb.flat_index_K, device)
                    loss_K, stats = token_loss(logprobs_K, entropy_K, tokens)
                    loss = (weights_K * loss_K).sum()
                    if not torch.isfinite(loss):
                        finite = False
                        if self.sync.stops_early:
                            break
                    # (``isfinite`` above waited for the forward, ``float`` below for the backward: the
                    # timings need no synchronisation of their own on an accelerator)
                    backward_start = time.perf_counter()
                    forward_s += backward_start - start
                    scaled = loss if self.grad_scaler is None else self.grad_scaler.scale(loss)
                    scaled.backward()  # after a non-finite loss only to keep collectives in step
                    if not finite:
                        backward_s += time.perf_counter() - backward_start
                        continue
                    total_loss += float(loss.detach())
                    backward_s += time.perf_counter() - backward_start
                    active_tokens = float((weights_K != 0).sum())
                    stat_weight += active_tokens
                    for name, value in stats.items():
                        if name.endswith("_max"):  # a maximum stays one over micro-batches and ranks
                            key = MAX_PREFIX + name
                            stat_sums[key] = max(stat_sums.get(key, value), value)
                        else:
                            stat_sums[name] = stat_sums.get(name, 0.0) + value * active_tokens
        finally:
            self.model.eval()
        if len(active) < len(weighted) and passes == 0:
            # What the skipped backward passes would have left: exact zeros, so that the optimizer
            # steps (momentum, weight decay) as it would have.
            for param in self.trainable_parameters:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
        optimizer_start = time.perf_counter()
        totals = self.sync.reduce(
            {**stat_sums, _LOSS: total_loss, _WEIGHT: stat_weight, _NON_FINITE: 0.0 if finite else 1.0}
        )
        total_loss, stat_weight = totals.pop(_LOSS), totals.pop(_WEIGHT)
        finite = totals.pop(_NON_FINITE) == 0
        grad_norm = float("nan")
        finite_loss = finite
        if finite:
            if self.grad_scaler is not None:
                self.grad_scaler.unscale_(self.optimizer)  # (an overflow leaves inf: skipped below)
            grad_norm = self.sync.grad_norm(self.trainable_parameters, self.config.max_grad_norm)
            finite = math.isfinite(grad_norm)
        lr = self.scheduler.get_last_lr()[0]
        if finite:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
        else:
            self.skipped_updates += 1
            logger.warning(
                "skipped a non-finite update (loss %s, grad norm %s); %d skipped so far",
                total_loss if finite_loss else "non-finite",
                grad_norm,
                self.skipped_updates,
            )
        if self.grad_scaler is not None and finite_loss:  # it checked the gradients: unscale_
            self.grad_scaler.update()  # halved after an overflow, doubled after 2000 steps without
        self.optimizer.zero_grad(set_to_none=True)
        metrics = {
            "loss/policy": total_loss if finite else float("nan"),
            "grad_norm": grad_norm,
            "lr": lr,
            "update/skipped": 0.0 if finite else 1.0,
            # the share of this mini-batch's micro-batches not forwarded because their loss is zero
            "update/zero_loss_skipped": (len(weighted) - len(active)) / max(len(weighted), 1),
            # this rank's seconds (docs/training.md, "Metrics"); ppo_update sums them over the step
            "time/learner_forward": forward_s,
            "time/learner_backward": backward_s,
            "time/optimizer": time.perf_counter() - optimizer_start,
        }
        metrics.update(
            {
                name.removeprefix(MAX_PREFIX): s if name.startswith(MAX_PREFIX) else s / max(stat_weight, 1.0)
                for name, s in totals.items()
            }
        )
        return metrics

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "optimizer_steps": self.optimizer_steps,
            "skipped_updates": self.skipped_updates,
            **({} if self.grad_scaler is None else {"grad_scaler": self.grad_scaler.state_dict()}),
        }

    def load_state_dict(self, state: Mapping) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps = state["optimizer_steps"]
        self.skipped_updates = state["skipped_updates"]
        if self.grad_scaler is not None and "grad_scaler" in state:
            self.grad_scaler.load_state_dict(state["grad_scaler"])
