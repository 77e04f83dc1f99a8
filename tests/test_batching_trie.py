"""Prefix tries over a whole micro-batch: the structure shares exactly the common prefixes, and the
trie layout gives exactly the per-step log-probs and gradients (a system prompt shared by several
GRPO groups; sliding-window and re-rendered contexts whose steps share a head and part of their
history without extending each other)."""

from __future__ import annotations

import random

import pytest
import torch
from batching_support import layout_logprobs_and_grads, reference_logprobs

from agent_r1.train.batch import batch_of
from agent_r1.train.batching import (
    PrefixTree,
    StepRows,
    TrainSequence,
    count_tokens,
    pack_trees,
    share_prefixes,
)
from agent_r1.types import Step, Trajectory


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def _sequence(*parts: list[int]) -> TrainSequence:
    return TrainSequence(tuple(t for part in parts for t in part), ())


def _sequences(trajectories: list[Trajectory]) -> tuple[TrainSequence, ...]:
    return batch_of(trajectories, micro_batch_tokens=4096).sequences


def _attends_by_definition(tree: PrefixTree) -> torch.Tensor:
    """(L, L) the definition of the mask: query q sees key k when some member holds k at a position
    at or before the one where it holds q."""
    layout = tree.layout()
    attends = torch.zeros(len(tree), len(tree), dtype=torch.bool)
    for index in layout.member_index:
        attends[index[:, None], index[None, :]] |= torch.ones(len(index), len(index), dtype=torch.bool).tril()
    return attends


def test_the_trie_shares_exactly_the_common_prefixes():
    system, task_a, task_b, x, y = [10, 11, 12, 13, 14, 15], [20, 21, 22], [30, 31, 32], [40, 41], [50, 51]
    a = _sequence(system, task_a, x, [1, 2])
    b = _sequence(system, task_a, x, [2])
    c = _sequence(system, task_a, y, [1])
    d = _sequence(system, task_b, [1, 2])
    # leading tokens each pair shares: a, b: system + task A + x; with c: system + task A; d: system
    common = {"ab": 11, "ac": 9, "bc": 9, "ad": 6, "bd": 6, "cd": 6}
    (tree,) = share_prefixes([d, c, b, a], pair_cost=1e-6, max_width=4096)
    assert tree.members == (a, b, c, d)  # token order
    assert tree.branch_at == (0, 11, 9, 6)
    assert tree.trunk == len(system)
    # each shared run once: system, task A, x, y, task B, then the four leaves' own tokens
    assert len(tree) == count_tokens([tree]) == 6 + 3 + 2 + 2 + 3 + (2 + 1 + 1 + 2)
    layout = tree.layout()
    for m, index in zip(tree.members, layout.member_index, strict=True):
        assert layout.token_ids_L[index].tolist() == list(m.token_ids)
        assert layout.position_ids_L[index].tolist() == list(range(len(m)))
    index = dict(zip("abcd", layout.member_index, strict=True))
    for pair, shared in common.items():
        p, m = index[pair[0]], index[pair[1]]
        n = min(len(p), len(m))
        # the same run exactly on the common prefix, separate runs after it
        assert (p[:n] == m[:n]).tolist() == [True] * shared + [False] * (n - shared), pair
    (mb,) = pack_trees(
        share_prefixes([a, b, c, d], pair_cost=1e-6, max_width=4096), StepRows((), (), ()), 4096
    )
    assert torch.equal(mb.attention_BTT[0], _attends_by_definition(tree))


def test_the_mask_is_the_definition_on_random_deep_tries():
    rng = random.Random(1)
    sequences = []
    for _ in range(12):
        # extensions of earlier sequences cut anywhere, over a 3-token alphabet, so that many levels
        # of sharing occur
        base = rng.choice(sequences).token_ids if sequences and rng.random() < 0.7 else ()
        tail = tuple(rng.randrange(3, 6) for _ in range(rng.randint(1, 5)))
        sequences.append(TrainSequence(base[: rng.randint(0, len(base))] + tail, ()))
    sequences += [sequences[3], sequences[7]]  # duplicates add no token
    trees = share_prefixes(sequences, pair_cost=1e-9, max_width=4096)
    assert count_tokens(trees) < count_tokens(sequences)
    assert max(len(set(t.branch_at)) for t in trees) >= 3  # branch points at several depths
    for tree in trees:
        if len(tree.members) > 1:
            (mb,) = pack_trees([tree], StepRows((), (), ()), 4096)
            assert torch.equal(mb.attention_BTT[0], _attends_by_definition(tree))


def test_a_branch_point_beyond_the_common_prefix_is_refused():
    a, b = _sequence([5, 6, 7]), _sequence([5, 6, 8])
    PrefixTree((a, b), (0, 2))
    with pytest.raises(ValueError, match=r"member 1 shares 2 leading tokens with member 0.*branch_at\[1\]"):
        PrefixTree((a, b), (0, 3))
    with pytest.raises(ValueError, match="one branch_at per member"):
        PrefixTree((a, b), (0,))


def test_the_cost_model_and_the_width_gate_the_trie():
    rng = random.Random(2)
    system = _tokens(rng, 30)
    groups = [
        [_sequence(system, task, _tokens(rng, 10)) for _ in range(3)]
        for task in (_tokens(rng, 5), _tokens(rng, 5))
    ]
    sequences = [s for g in groups for s in g]
    # cheap attention: one trie over both groups, the system prompt computed once
    (tree,) = share_prefixes(sequences, pair_cost=1e-6, max_width=4096)
    assert tree.trunk == 30 and len(tree) == 30 + 2 * 5 + 6 * 10
    # Each group's trie is 65 tokens (30 + 5 + 3 x 10); a 45-token member of the next group joining it
    # saves its 30 system tokens but costs 80^2 - 65^2 - 45^2 = 150 more attention pairs, so it pays
    # only while a pair costs less than 0.2 tokens; above that each group keeps its own trie.
    per_group = share_prefixes(sequences, pair_cost=0.5, max_width=4096)
    assert sorted(t.trunk for t in per_group) == [35, 35]
    narrow = share_prefixes(sequences, pair_cost=1e-6, max_width=80)
    assert all(len(t) <= 80 for t in narrow) and len(narrow) > 1


def _step(prompt: list[int], response: list[int]) -> Step:
    return Step(prompt_ids=prompt, response_ids=response, logprobs=[-1.0] * len(response))


def _sliding_window_group(rng: random.Random, system: list[int], samples: int, turns: int, k: int):
    """GRPO samples of one task under a sliding window of ``k`` turns: step t's prompt is the head
    (system + task) and turns t-k..t-1. Sample 1 repeats sample 0's first two turns (a deterministic
    environment answers the same action the same way), so their prompts share head and history."""
    head = system + _tokens(rng, rng.randint(4, 8))
    turns_of: list[list[tuple[list[int], list[int]]]] = []  # sample -> (response, observation) per turn
    trajectories = []
    for s in range(samples):
        turns_of.append([])
        steps = []
        for t in range(turns):
            if s == 1 and t < 2:
                response, observation = turns_of[0][t]
            else:
                response, observation = _tokens(rng, rng.randint(1, 5)), _tokens(rng, rng.randint(2, 4))
            window = [tok for r, o in turns_of[s][-k:] for tok in r + o]
            steps.append(_step(head + window, response))
            turns_of[s].append((response, observation))
        trajectories.append(Trajectory(task_id="w", steps=tuple(steps)))
    return head, trajectories


def _rerendered(rng: random.Random, system: list[int], turns: int) -> Trajectory:
    """A re-rendered history (a template that drops past reasoning): step t+1's prompt is step t's
    prompt + the response without its first half + an observation, so it extends step t's prompt but
    not its prompt + response."""
    prompt, steps = system + _tokens(rng, 5), []
    for _ in range(turns):
        response = _tokens(rng, rng.randint(2, 6))
        steps.append(_step(prompt, response))
        prompt = prompt + response[len(response) // 2 :] + _tokens(rng, rng.randint(2, 4))
    return Trajectory(task_id="r", steps=tuple(steps))


def _groups_sharing_a_system_prompt(rng: random.Random, system: list[int]) -> list[Trajectory]:
    """Three GRPO groups (different tasks) of three 2-turn append-context samples, one system prompt."""
    trajectories = []
    for _ in range(3):
        task = _tokens(rng, rng.randint(5, 9))
        for _ in range(3):
            prompt, steps = system + task, []
            for _ in range(2):
                response = _tokens(rng, rng.randint(1, 5))
                steps.append(_step(prompt, response))
                prompt = prompt + response + _tokens(rng, rng.randint(2, 4))
            trajectories.append(Trajectory(task_id="g", steps=tuple(steps)))
    return trajectories


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_tries_give_the_per_step_logprobs_and_gradients(tiny_checkpoint, kernel):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint, dtype=torch.float32, attn_implementation=kernel
    )
    rng = random.Random(3)
    system = _tokens(rng, 40)
    grpo = _groups_sharing_a_system_prompt(rng, system)
    head, window = _sliding_window_group(rng, system, samples=3, turns=6, k=2)
    cases = {
        "GRPO groups sharing a system prompt": grpo,
        "sliding window": window,
        "re-rendered": [_rerendered(rng, system, 5)],
    }
    cases["all together"] = [t for ts in cases.values() for t in ts]

    # (a) one trie over every group: the system prompt once, each task once below it
    (tree,) = share_prefixes(_sequences(grpo), pair_cost=1e-6, max_width=4096)
    assert tree.trunk == len(system) and len(tree.members) == 9
    # (b) the steps of a sliding window share the head, and sample 1's share history with sample 0's
    window_trees = share_prefixes(_sequences(window), pair_cost=1e-6, max_width=4096)
    assert [t.trunk for t in window_trees] == [len(head)]
    assert max(window_trees[0].branch_at) > len(head)
    rerendered = _sequences(cases["re-rendered"])
    assert len(rerendered) == 5  # no step extends the previous one's prompt + response
    assert (
        count_tokens(share_prefixes(rerendered, pair_cost=1e-6, max_width=4096))
        < count_tokens(rerendered) / 2
    )

    for name, trajectories in cases.items():
        with torch.no_grad():
            expected = reference_logprobs(model, trajectories)
        plain, plain_grads, plain_mbs = layout_logprobs_and_grads(
            model, trajectories, merge=False, pair_cost=None, budget=4096, seed=7
        )
        assert torch.allclose(plain, expected, atol=1e-5, rtol=0), name
        for budget in (4096, 150):
            out, grads, mbs = layout_logprobs_and_grads(
                model, trajectories, merge=True, pair_cost=1e-6, budget=budget, seed=7
            )
            assert any(mb.attention_BTT is not None for mb in mbs), name
            assert sum(mb.num_tokens for mb in mbs) < sum(mb.num_tokens for mb in plain_mbs), name
            assert torch.allclose(out, expected, atol=1e-5, rtol=0), (name, budget)
            for param in plain_grads:
                assert torch.allclose(grads[param], plain_grads[param], atol=1e-5, rtol=1e-4), (
                    name,
                    budget,
                    param,
                )
