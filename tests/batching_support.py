"""What the batching tests compare layouts against: the per-step definition of the log-probs, and one
layout's log-probs and gradients (tests/test_batching.py, tests/test_batching_trie.py); and the small
random multi-turn trajectories the learner tests train on."""

from __future__ import annotations

import random

import torch

from agent_r1.train.batch import batch_of
from agent_r1.train.learner import micro_batch_logprobs
from agent_r1.types import Step, Trajectory

TEMPERATURE = 0.7


def random_trajectories(seed: int, count: int = 3) -> list[Trajectory]:
    """``count`` trajectories of 1-3 appended steps over random token ids (3..249), each response 2-5
    tokens sampled at log-prob -5."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        prompt, steps = [rng.randrange(3, 250) for _ in range(6)], []
        for _ in range(rng.randint(1, 3)):
            response = [rng.randrange(3, 250) for _ in range(rng.randint(2, 5))]
            steps.append(Step(prompt_ids=prompt, response_ids=response, logprobs=[-5.0] * len(response)))
            prompt = prompt + response + [rng.randrange(3, 250) for _ in range(3)]
        out.append(Trajectory(task_id="t", steps=tuple(steps)))
    return out


def reference_logprobs(model, trajectories) -> torch.Tensor:
    """The definition: one forward per step over its own prompt + response, batch of one."""
    out = []
    for trajectory in trajectories:
        for step in trajectory.steps:
            ids = torch.tensor([step.prompt_ids + step.response_ids])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].float() / TEMPERATURE, -1)
            p = len(step.prompt_ids)
            positions = torch.arange(p - 1, p - 1 + len(step.response_ids))
            out.append(logprobs[positions, torch.tensor(step.response_ids)])
    return torch.cat(out)


def layout_logprobs_and_grads(model, trajectories, *, merge: bool, pair_cost, budget: int, seed: int):
    """The scored tokens' log-probs through ``batch_of``'s micro-batches, the gradients of a fixed
    random weighting of them, and the micro-batches."""
    batch = batch_of(trajectories, micro_batch_tokens=budget, pair_cost=pair_cost, merge=merge)
    rows = batch.rows
    weights = torch.randn(rows.num_tokens, generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    micro_batches = batch.micro_batches[0]
    out = torch.zeros(rows.num_tokens)
    for mb in micro_batches:
        logprobs_K, _ = micro_batch_logprobs(model, mb, TEMPERATURE)
        out = out.index_put((mb.flat_index_K,), logprobs_K)
    (weights * out).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.detach(), grads, micro_batches
