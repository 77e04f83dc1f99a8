"""The chunked LM head at the scored positions gives the full-logits log-probs, entropies and gradients."""

from __future__ import annotations

import random

import pytest
import torch

from agent_r1.models.tiny import build_tiny_model
from agent_r1.train.batch import batch_of
from agent_r1.train.learner import full_logits_logprobs, micro_batch_logprobs, model_inputs
from agent_r1.train.lm_head import chunked_head_logprobs, scored_logprobs
from agent_r1.types import Step, Trajectory

VOCAB = 300


def _trajectories(seed: int) -> list[Trajectory]:
    rng = random.Random(seed)
    out = []
    for _ in range(4):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(5, 12))]
        steps = []
        for _ in range(rng.randint(1, 3)):
            response = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 6))]
            steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[-1.0] * len(response)))
            prompt = prompt + response + [rng.randrange(3, VOCAB) for _ in range(3)]
        out.append(Trajectory(task_id="t", steps=tuple(steps)))
    return out


def _micro_batches(pair_cost=None):
    trajectories = _trajectories(0)
    return batch_of(trajectories, micro_batch_tokens=64, pair_cost=pair_cost).micro_batches[0]


def _model(dtype, bias: bool = False):
    model = build_tiny_model(VOCAB, hidden_size=32, num_layers=2, intermediate_size=64, seed=3).to(dtype)
    if bias:  # untie the head and give it a bias, so the bias gradient is checked too
        head = torch.nn.Linear(32, VOCAB, bias=True, dtype=dtype)
        torch.manual_seed(4)
        torch.nn.init.normal_(head.weight, std=0.05)
        torch.nn.init.normal_(head.bias, std=0.5)
        model.lm_head = head
    return model.eval()


def _loss_and_grads(model, compute):
    model.zero_grad(set_to_none=True)
    outputs = []
    for mb in _micro_batches():
        logprobs_K, entropy_K = compute(model, mb)
        # weights of both signs, so that every term of the backward is exercised
        signs_K = torch.linspace(-1.0, 2.0, logprobs_K.shape[0])
        loss = (signs_K * logprobs_K).sum() + 0.3 * entropy_K.sum()
        loss.backward()
        outputs.append(torch.cat([logprobs_K.detach(), entropy_K.detach()]))
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(outputs), grads


def _full(model, mb):
    inputs = model_inputs(model, mb)
    return full_logits_logprobs(model, inputs, mb.logit_index_K, mb.target_ids_K, 0.7, with_entropy=True)


def _chunked(model, mb):
    inputs = model_inputs(model, mb)
    # 7 logits rows per chunk: every micro-batch spans several chunks
    out = scored_logprobs(
        model, inputs, mb.logit_index_K, mb.target_ids_K, 0.7, with_entropy=True, chunk_elements=7 * VOCAB
    )
    assert out is not None, "a plain Qwen2 head must take the chunked path"
    return out


@pytest.mark.parametrize("bias", [False, True], ids=["tied-head", "head-with-bias"])
def test_chunked_head_matches_full_logits_in_fp32(bias):
    model = _model(torch.float32, bias=bias)
    full, full_grads = _loss_and_grads(model, _full)
    chunked, chunked_grads = _loss_and_grads(model, _chunked)
    # fp32: the same per-row products and reductions up to summation order, ~1e-6 relative
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)
    assert chunked_grads.keys() == full_grads.keys()
    for name, grad in full_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_chunked_head_matches_full_logits_in_bf16():
    model = _model(torch.bfloat16)
    full, full_grads = _loss_and_grads(model, _full)
    chunked, chunked_grads = _loss_and_grads(model, _chunked)
    # The logits are bf16 products in both paths (the same rows; kernels may block them differently,
    # one bf16 ulp = 2^-8 relative); log-softmax runs in fp32 on them.
    torch.testing.assert_close(chunked, full, rtol=2e-2, atol=2e-2)
    for name, grad in full_grads.items():
        # the chunked backward accumulates the head's weight gradient in fp32 (autograd: bf16 GEMM)
        scale = float(grad.abs().max()) + 1e-6
        assert float((chunked_grads[name] - grad).abs().max()) <= 2e-2 * scale, name


def test_chunking_does_not_change_the_result():
    torch.manual_seed(0)
    hidden_KH = torch.randn(23, 16)
    head = torch.nn.Linear(16, 50)
    targets_K = torch.randint(0, 50, (23,))
    one, one_entropy = chunked_head_logprobs(hidden_KH, head, targets_K, 1.3, with_entropy=True)
    many, many_entropy = chunked_head_logprobs(
        hidden_KH, head, targets_K, 1.3, with_entropy=True, chunk_elements=3 * 50
    )
    expected = torch.log_softmax(head(hidden_KH) / 1.3, -1)
    torch.testing.assert_close(one, expected.gather(-1, targets_K[:, None])[:, 0])
    torch.testing.assert_close(many, one)
    torch.testing.assert_close(many_entropy, one_entropy)
    torch.testing.assert_close(one_entropy, -(expected.exp() * expected).sum(-1))


def test_prefix_tree_micro_batches_take_the_chunked_path_with_the_same_logprobs():
    model = _model(torch.float32)
    for mb in _micro_batches(pair_cost=0.0):
        with torch.no_grad():
            full, _ = _full(model, mb)
            chunked, _ = micro_batch_logprobs(model, mb, 0.7, with_entropy=True)
        torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-5)


def test_a_model_that_post_processes_its_logits_falls_back_to_the_full_path():
    """Gemma-2 soft-caps its logits after the head: the chunked path must not skip that."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        final_logit_softcapping=5.0,
    )
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config).eval()
    mb = _micro_batches()[0]
    inputs = model_inputs(model, mb)
    with torch.no_grad():
        assert scored_logprobs(model, inputs, mb.logit_index_K, mb.target_ids_K, 1.0) is None
        got, _ = micro_batch_logprobs(model, mb, 1.0)
        expected, _ = full_logits_logprobs(model, inputs, mb.logit_index_K, mb.target_ids_K, 1.0)
    torch.testing.assert_close(got, expected)


def test_a_lora_wrapped_head_falls_back_to_the_full_path():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        _model(torch.float32), LoraConfig(r=2, target_modules=["lm_head", "q_proj"], task_type="CAUSAL_LM")
    )
    mb = _micro_batches()[0]
    inputs = model_inputs(model, mb)
    with torch.no_grad():
        assert scored_logprobs(model, inputs, mb.logit_index_K, mb.target_ids_K, 1.0) is None
