"""agent_r1.train.sft: demonstrations replayed through the env, loss on assistant tokens only."""

from __future__ import annotations

import random

import pytest
import torch

from agent_r1.models.tiny import build_tiny_model, build_tiny_tokenizer
from agent_r1.tasks import arithmetic
from agent_r1.train.sft import (
    SFTConfig,
    _padded_batch,
    replay_demonstrations,
    sft_loss,
    sft_sequences,
    train_sft,
)


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def _sequences(tok, n=8):
    tasks = arithmetic.make_dataset(n, seed=2)
    return tasks, sft_sequences(
        replay_demonstrations(lambda: arithmetic.make_env(tok), tok, tasks, arithmetic.demonstrate, seed=1)
    )


def test_targets_are_exactly_the_assistant_responses(tok):
    tasks, sequences = _sequences(tok)
    rng = random.Random(1)
    _, target_BT = _padded_batch(sequences, tok.pad_token_id)
    for i, (task, seq) in enumerate(zip(tasks, sequences, strict=True)):
        responses = arithmetic.demonstrate(task, rng)
        targets = [
            tok_id
            for tok_id, is_target in zip(seq.token_ids, target_BT[i, : len(seq)].tolist(), strict=True)
            if is_target
        ]
        expected = [
            t for text in responses for t in tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        ]
        assert targets == expected
        assert len(seq.spans) == len(responses)


def test_right_padding_needs_no_attention_mask(tok):
    """The warm start runs its padded batches without a mask: every real token's logits are those of
    its sequence run alone (causal attention never looks at the padding after it)."""
    _, sequences = _sequences(tok)
    assert len({len(s) for s in sequences}) > 1, "the batch must hold sequences of several lengths"
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id).eval()
    ids_BT, _ = _padded_batch(sequences, tok.pad_token_id)
    with torch.no_grad():
        padded_BTV = model(input_ids=ids_BT).logits
        for i, seq in enumerate(sequences):
            alone_TV = model(input_ids=torch.tensor([seq.token_ids])).logits[0]
            # fp32 sums of 128-term products in another order: 4e-7 measured on logits of magnitude ~1.
            torch.testing.assert_close(padded_BTV[i, : len(seq)], alone_TV, rtol=0, atol=1e-5)


def test_replay_rejects_a_demonstration_that_does_not_fit(tok):
    tasks = arithmetic.make_dataset(1, seed=0)
    with pytest.raises(ValueError, match="ended after response 1 of 2"):
        replay_demonstrations(
            lambda: arithmetic.make_env(tok), tok, tasks, lambda t, r: ["<answer>1</answer>", "x"]
        )
    with pytest.raises(ValueError, match="did not end after response 1 of 1"):
        replay_demonstrations(
            lambda: arithmetic.make_env(tok), tok, tasks, lambda t, r: [arithmetic.tool_call_text("1*2")]
        )


def test_train_sft_lowers_the_loss_and_touches_only_given_sequences(tok):
    _, sequences = _sequences(tok)
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    losses = train_sft(
        model,
        sequences,
        SFTConfig(epochs=6, batch_size=8, micro_batch_size=4, lr=3e-3),
        pad_token_id=tok.pad_token_id,
    )
    assert len(losses) == 6
    assert losses[-1] < losses[0] - 1.0
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="no sequences"):
        train_sft(model, [], pad_token_id=tok.pad_token_id)
    with pytest.raises(ValueError, match="batch_size"):
        SFTConfig(batch_size=0)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_shared_prefixes_give_the_padded_batch_loss_and_gradients(tok, kernel):
    """The default warm start forwards a batch as prefix tries (the system prompt once, attention by
    segments under SDPA on the CPU, the dense tree mask under eager): the loss and every gradient
    are the right-padded batch's, to float rounding, with fewer tokens forwarded."""
    from agent_r1.train.batching import count_tokens, share_prefixes

    _, sequences = _sequences(tok)
    trees = share_prefixes(sequences, pair_cost=0.0, max_width=10**6)
    assert count_tokens(trees) < 0.8 * sum(len(s) for s in sequences)  # they share the system prompt
    torch.manual_seed(0)
    model = build_tiny_model(len(tok), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model.set_attn_implementation(kernel)
    n_targets = sum(span.length for s in sequences for span in s.spans)
    results = {}
    for share in (False, True):
        model.zero_grad(set_to_none=True)
        loss = sft_loss(model, sequences, pad_token_id=tok.pad_token_id, share=share) / n_targets
        loss.backward()
        results[share] = loss.detach(), [p.grad.clone() for p in model.parameters()]
    (padded, padded_grads), (shared, shared_grads) = results[False], results[True]
    # fp32 sums of the same terms in another order (the trie tests' bounds, tests/test_batching_trie.py)
    torch.testing.assert_close(shared, padded, rtol=1e-5, atol=0)
    for a, b in zip(shared_grads, padded_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
