"""Log-probs of the scored tokens without the logits of every position.

A causal LM's forward ends in ``logits = lm_head(hidden)`` for every position of every row: with a
150k vocabulary and a 32k-token micro-batch that is ~10 GB in bf16, before the fp32 copy and the
softmax, although the learner needs the distribution at the scored positions only (the response
tokens, often a minority). ``scored_logprobs`` instead

1. runs the model's own forward, with hooks on its output-embedding module (``lm_head``): the input
   hidden states are captured and the head is applied to an empty slice, so no logits are computed;
2. gathers the hidden states of the scored positions (``MicroBatch.logit_index_K``);
3. applies the head there in chunks of rows (``chunk_elements`` logits at a time) inside one autograd
   function whose backward recomputes each chunk's logits, so neither the forward nor the backward
   ever holds more than one chunk of (rows, vocab) logits.

The result is returned through the head's forward hook as the model's ``logits`` output, so wrappers
that hook the model's outputs (DDP, FSDP2's root) see it flow through the forward, and the head's
weight is read while the wrapper has it gathered.

Exactness: per row, the same ``hidden @ W.T + b`` in the model's dtype, divided by the temperature in
fp32, and the same log-softmax as the full-logits path (``agent_r1.train.learner``); the backward is the
analytic gradient of log p(target) and of the entropy. Results match the full path to float rounding
(tested, fp32 and bf16).

Under autocast (``model.compute_dtype``, ``agent_r1.models.precision``) the head's matrix multiplies
run in autocast's dtype, in the forward and in the recomputing backward alike (autocast does not
reach a custom function's backward, so the function casts explicitly); the logits are upcast to fp32
before the log-softmax, the gathered log-prob and the entropy, and the gradients reach the weights in
their own dtype.

When the head is not a plain ``nn.Linear`` (e.g. a LoRA-wrapped head) or the model post-processes its
logits (soft-capping, scaling: detected because the model's ``logits`` output is then not the tensor the
hook returned), ``scored_logprobs`` returns None and the caller takes the full-logits path.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["CHUNK_ELEMENTS", "chunked_head_logprobs", "output_head", "scored_logprobs"]

CHUNK_ELEMENTS = 2**25
"""Logits computed at once: 128 MiB in fp32; with a 152k vocabulary, 220 rows per chunk (a GEMM of
220 x hidden x vocab still keeps a GPU busy; the backward holds two such buffers)."""


class _ChunkedHeadLogprobs(torch.autograd.Function):
    """(hidden_KH, weight_VH, bias_V) -> log p(target) (K,) and entropy (K,), chunked over K; the
    head's matrix multiplies in autocast's dtype when it is on (else the weight's), the rest in fp32."""

    @staticmethod
    def forward(ctx, hidden_KH, weight_VH, bias_V, targets_K, temperature, with_entropy, chunk_rows):
        device_type = hidden_KH.device.type
        head_dtype = (
            torch.get_autocast_dtype(device_type)
            if torch.is_autocast_enabled(device_type)
            else weight_VH.dtype
        )
        K = hidden_KH.shape[0]
        logprobs_K = torch.empty(K, dtype=torch.float32, device=hidden_KH.device)
        logsumexp_K = torch.empty_like(logprobs_K)
        entropy_K = torch.empty_like(logprobs_K) if with_entropy else None
        cast_weight_VH, cast_bias_V = _cast(weight_VH, head_dtype), _cast(bias_V, head_dtype)
        with torch.autocast(device_type, enabled=False):
            for start in range(0, K, chunk_rows):
                rows = slice(start, start + chunk_rows)
                z_CV = _logits(hidden_KH[rows], cast_weight_VH, cast_bias_V, temperature)
                lse_C = torch.logsumexp(z_CV, dim=-1)
                logsumexp_K[rows] = lse_C
                logprobs_K[rows] = z_CV.gather(-1, targets_K[rows, None])[:, 0] - lse_C
                if with_entropy:
                    # H = logsumexp(z) - E_p[z]
                    entropy_K[rows] = lse_C - (torch.exp(z_CV - lse_C[:, None]) * z_CV).sum(-1)
        ctx.save_for_backward(hidden_KH, weight_VH, bias_V, targets_K, logsumexp_K, entropy_K)
        ctx.temperature, ctx.chunk_rows, ctx.head_dtype = temperature, chunk_rows, head_dtype
        if entropy_K is None:
            return logprobs_K, torch.zeros(0, device=hidden_KH.device)
        return logprobs_K, entropy_K

    @staticmethod
    def backward(ctx, grad_logprobs_K, grad_entropy_K):
        hidden_KH, weight_VH, bias_V, targets_K, logsumexp_K, entropy_K = ctx.saved_tensors
        temperature, chunk_rows, head_dtype = ctx.temperature, ctx.chunk_rows, ctx.head_dtype
        with_entropy = entropy_K is not None and grad_entropy_K is not None and grad_entropy_K.numel() > 0
        grad_hidden_KH = torch.zeros_like(hidden_KH) if ctx.needs_input_grad[0] else None
        grad_weight_VH = torch.zeros_like(weight_VH, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_bias_V = (
            torch.zeros_like(bias_V, dtype=torch.float32)
            if bias_V is not None and ctx.needs_input_grad[2]
            else None
        )
        cast_weight_VH, cast_bias_V = _cast(weight_VH, head_dtype), _cast(bias_V, head_dtype)
        with torch.autocast(hidden_KH.device.type, enabled=False):  # on when backward() runs under it
            for start in range(0, hidden_KH.shape[0], chunk_rows):
                rows = slice(start, start + chunk_rows)
                z_CV = _logits(hidden_KH[rows], cast_weight_VH, cast_bias_V, temperature)
                p_CV = torch.exp(z_CV - logsumexp_K[rows, None])
                # Two (rows, vocab) buffers, updated in place: p becomes the gradient, z the entropy term.
                if with_entropy:
                    # dH / dz_j = -p_j (z_j - E_p[z]),  E_p[z] = logsumexp(z) - H
                    mean_z_C = logsumexp_K[rows] - entropy_K[rows]
                    entropy_term_CV = z_CV.sub_(mean_z_C[:, None]).mul_(p_CV).mul_(grad_entropy_K[rows, None])
                # d log p(t) / dz = onehot(t) - p
                grad_z_CV = p_CV.mul_(-grad_logprobs_K[rows, None])
                grad_z_CV.scatter_add_(-1, targets_K[rows, None], grad_logprobs_K[rows, None])
                if with_entropy:
                    grad_z_CV.sub_(entropy_term_CV)
                # z = (h W^T + b) / T; the gradient reaches the head's output in its dtype, as in autograd
                grad_out_CV = grad_z_CV.div_(temperature).to(head_dtype)
                if grad_hidden_KH is not None:
                    grad_hidden_KH[rows] = grad_out_CV @ cast_weight_VH
                if grad_weight_VH is not None:
                    grad_weight_VH += (grad_out_CV.T @ hidden_KH[rows].to(head_dtype)).float()
                if grad_bias_V is not None:
                    grad_bias_V += grad_out_CV.float().sum(0)
        return (
            grad_hidden_KH,
            None if grad_weight_VH is None else grad_weight_VH.to(weight_VH.dtype),
            None if grad_bias_V is None else grad_bias_V.to(bias_V.dtype),
            None,
            None,
            None,
            None,
        )


def _cast(parameter: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``parameter`` in ``dtype`` (itself when it is already), as autocast would cast it."""
    return None if parameter is None else parameter.to(dtype)


def _logits(hidden_CH: Tensor, weight_VH: Tensor, bias_V: Tensor | None, temperature: float) -> Tensor:
    """The head's logits for a chunk of rows, in its dtype, then divided by the temperature in fp32."""
    out_CV = nn.functional.linear(hidden_CH.to(weight_VH.dtype), weight_VH, bias_V)
    return out_CV.float() / temperature


def chunked_head_logprobs(
    hidden_KH: Tensor,
    head: nn.Linear,
    targets_K: Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None]:
    """log softmax(head(hidden) / temperature) at ``targets_K`` (K,), and the entropy (K,) or None."""
    chunk_rows = max(1, chunk_elements // head.weight.shape[0])
    logprobs_K, entropy_K = _ChunkedHeadLogprobs.apply(
        hidden_KH, head.weight, head.bias, targets_K, temperature, with_entropy, chunk_rows
    )
    return logprobs_K, entropy_K if with_entropy else None


def output_head(model) -> nn.Linear | None:
    """The output-embedding module of a (DDP-, FSDP2- or peft-wrapped) HF model, if a plain Linear."""
    inner = getattr(model, "module", model)  # DDP
    get = getattr(inner, "get_output_embeddings", None)
    head = get() if get is not None else None
    return head if type(head) is nn.Linear else None


def scored_logprobs(
    model,
    inputs: dict[str, Tensor],
    logit_index_K: Tensor,
    targets_K: Tensor,
    temperature: float,
    *,
    with_entropy: bool = False,
    chunk_elements: int = CHUNK_ELEMENTS,
) -> tuple[Tensor, Tensor | None] | None:
    """Run ``model(**inputs)`` and return the log-probs (K,) and entropies at the scored positions,
    computed by ``chunked_head_logprobs``; None when the model's head does not allow it."""
    head = output_head(model)
    if head is None:
        return None
    captured: dict[str, Tensor] = {}

    def before_head(module, args):
        captured["hidden"] = args[0]
        return (args[0][:, :0],)  # the head runs on no position

    def after_head(module, args, output):
        hidden_KH = captured.pop("hidden").flatten(0, 1)[logit_index_K]
        logprobs_K, entropy_K = chunked_head_logprobs(
            hidden_KH,
            module,
            targets_K,
            temperature,
            with_entropy=with_entropy,
            chunk_elements=chunk_elements,
        )
        stacked = torch.stack([logprobs_K, logprobs_K if entropy_K is None else entropy_K], dim=-1)
        captured["result"] = stacked[None]  # (1, K, 2): what the model returns as its logits
        return captured["result"]

    handles = [head.register_forward_pre_hook(before_head), head.register_forward_hook(after_head)]
    try:
        out = model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    if out.logits is not captured.get("result"):
        return None  # the model post-processed its logits: the caller recomputes them in full
    logprobs_K, entropy_K = out.logits[0].unbind(-1)
    return logprobs_K, entropy_K if with_entropy else None
