"""The learner: exact micro-batch accumulation, skipped non-finite updates, LoRA reference, schedules."""

from __future__ import annotations

import pytest
import torch
from batching_support import random_trajectories

from agent_r1.algos import TokenFields, aggregation_weights
from agent_r1.train.batch import batch_of
from agent_r1.train.config import ModelConfig, TrainerConfig, config_from_dict
from agent_r1.train.learner import Learner, MiniBatch, load_policy, lr_lambda


def _mini_batch(trajectories, budget):
    batch = batch_of(trajectories, micro_batch_tokens=budget)
    rows = batch.rows
    n = rows.num_tokens
    mask = torch.ones(n)
    seq_ids = torch.tensor([r for r, s in enumerate(rows.steps) for _ in s.response_ids])
    tokens = TokenFields(
        mask=mask,
        step_ids=seq_ids,
        traj_ids=torch.zeros(n, dtype=torch.long),
        sampler_logprobs=torch.full((n,), -5.0),
        old_logprobs=torch.full((n,), -5.0),
        advantages=torch.linspace(-1, 1, n),
    )
    weights = aggregation_weights(mask, "seq-mean-token-mean", seq_ids=seq_ids)
    return MiniBatch(batch.micro_batches[0], weights, tokens)


def _pg_loss(logprobs_K, entropy_K, tokens):
    return -tokens.advantages * torch.exp(logprobs_K - tokens.old_logprobs), {"ratio": 1.0}


def _learner(model, lr=1e-3):
    return Learner(model, TrainerConfig(lr=lr), temperature=1.0, total_optimizer_steps=10)


@pytest.fixture()
def policy(tiny_checkpoint):
    return load_policy(ModelConfig(path=str(tiny_checkpoint)))


def test_update_does_not_depend_on_the_micro_batch_split(tiny_checkpoint):
    trajectories = random_trajectories(0)
    results = []
    for budget in (16, 10_000):
        model = load_policy(ModelConfig(path=str(tiny_checkpoint)))
        metrics = _learner(model).update(_mini_batch(trajectories, budget), _pg_loss)
        results.append((metrics, {n: p.detach().clone() for n, p in model.named_parameters()}))
    (m_small, w_small), (m_large, w_large) = results
    assert len(_mini_batch(trajectories, 16).micro_batches) > 1
    assert m_small["loss/policy"] == pytest.approx(m_large["loss/policy"], abs=1e-6)
    assert m_small["grad_norm"] == pytest.approx(m_large["grad_norm"], rel=1e-5)
    for name in w_small:
        torch.testing.assert_close(w_small[name], w_large[name], atol=1e-4, rtol=0)  # Adam: ~lr * g / |g|


@pytest.mark.parametrize("poison", ["loss", "gradient"])
def test_non_finite_updates_are_skipped_and_never_reach_the_weights(policy, poison):
    learner = _learner(policy)
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    token_loss = _pg_loss
    hook = None
    if poison == "loss":

        def token_loss(logprobs_K, entropy_K, tokens):
            loss_K, stats = _pg_loss(logprobs_K, entropy_K, tokens)
            return loss_K * torch.tensor(float("nan")), stats
    else:
        param = next(p for p in policy.parameters() if p.requires_grad)
        hook = param.register_hook(lambda g: g * float("inf"))
    metrics = learner.update(_mini_batch(random_trajectories(1), 64), token_loss)
    if hook:
        hook.remove()
    assert metrics["update/skipped"] == 1.0 and learner.skipped_updates == 1 and learner.optimizer_steps == 0
    for name, p in policy.named_parameters():
        assert torch.equal(p, before[name]), name
    metrics = learner.update(
        _mini_batch(random_trajectories(1), 64), _pg_loss
    )  # the next healthy step applies
    assert metrics["update/skipped"] == 0.0 and learner.optimizer_steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in policy.named_parameters())


def test_lora_reference_is_the_base_model_with_the_adapter_disabled(tiny_checkpoint):
    config = config_from_dict({"model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}}})
    model = load_policy(config.model)
    base = load_policy(ModelConfig(path=str(tiny_checkpoint)))
    learner = _learner(model, lr=1e-2)
    mini = _mini_batch(random_trajectories(2), 10_000)
    n = mini.weights.numel()
    base_logprobs = Learner(base, TrainerConfig(), temperature=1.0, total_optimizer_steps=1).logprobs(
        mini.micro_batches, n
    )
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    for _ in range(3):
        learner.update(mini, _pg_loss)
    policy_logprobs = learner.logprobs(mini.micro_batches, n)
    reference_logprobs = learner.logprobs(mini.micro_batches, n, reference=True)
    torch.testing.assert_close(reference_logprobs, base_logprobs, atol=1e-5, rtol=0)
    assert (policy_logprobs - base_logprobs).abs().max() > 1e-3  # the adapter learned something
    for name, p in model.named_parameters():
        if name in frozen:
            assert torch.equal(p, frozen[name]), name


def test_gradient_checkpointing_and_bf16_give_the_same_update_direction(tiny_checkpoint):
    mini = _mini_batch(random_trajectories(3), 10_000)
    grads = {}
    for name, cfg in {
        "plain": ModelConfig(path=str(tiny_checkpoint)),
        "checkpointed": ModelConfig(path=str(tiny_checkpoint), gradient_checkpointing=True),
        "bf16": ModelConfig(path=str(tiny_checkpoint), dtype="bfloat16"),
    }.items():
        model = load_policy(cfg)
        learner = _learner(model)
        before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        metrics = learner.update(mini, _pg_loss)
        assert metrics["update/skipped"] == 0.0
        grads[name] = torch.cat(
            [(p.detach().float() - before[n]).flatten() for n, p in model.named_parameters()]
        )
    torch.testing.assert_close(grads["checkpointed"], grads["plain"], atol=1e-6, rtol=1e-4)
    cosine = torch.nn.functional.cosine_similarity(grads["bf16"], grads["plain"], dim=0)
    assert cosine > 0.9


def test_warmup_then_cosine_decay():
    factor = lr_lambda(TrainerConfig(warmup_steps=4, lr_schedule="cosine", min_lr_ratio=0.1), total_steps=14)
    values = [factor(s) for s in range(15)]
    assert values[:4] == pytest.approx([0.2, 0.4, 0.6, 0.8])
    assert values[4] == pytest.approx(1.0)
    assert values[9] == pytest.approx(0.1 + 0.9 * 0.5)
    assert values[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(values[4:-1], values[5:], strict=True))
    constant = lr_lambda(TrainerConfig(warmup_steps=0), total_steps=10)
    assert [constant(s) for s in range(3)] == [1.0, 1.0, 1.0]
