"""vLLM engine checks, run by ``tests/test_rollout_vllm.py`` with ``.venv-vllm/bin/python``.

One in-process vLLM engine on the tiny model (fp32, CPU) is asked for concurrent completions; the
returned log-probs are compared with a plain Hugging Face forward over prompt + response (the
learner's recomputation), weights are swapped in from a differently seeded model, and bad requests
are sent beside good ones. Prints one JSON object of measurements; exits non-zero on a failed check.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from agent_r1.models.tiny import save_tiny_checkpoint
from agent_r1.rollout.vllm_engine import VLLMEngine
from agent_r1.types import SamplingParams, StopReason


def recompute_logprobs(model, prompt, completion, temperature):
    ids = torch.tensor([list(prompt) + list(completion.token_ids)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    scaled = logits / (temperature or 1.0)
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return scaled.log_softmax(-1)[positions, ids[0, len(prompt) :]]


def logprob_gap(model, prompts, params, completions):
    gaps = []
    for prompt, p, c in zip(prompts, params, completions, strict=True):
        gaps.append((recompute_logprobs(model, prompt, c, p.temperature) - torch.tensor(c.logprobs)).abs())
    gaps = torch.cat(gaps)
    return float(gaps.max()), float(gaps.mean())


async def run_checks(engine, model, model_b, max_context) -> dict:
    results = {}
    prompts = [list(range(10, 10 + n)) for n in (5, 23, 61, 12)]
    params = [
        SamplingParams(temperature=t, max_tokens=24, seed=i) for i, t in enumerate((1.0, 0.7, 1.0, 0.0))
    ]
    too_long = [5 + i % 200 for i in range(max_context + 3)]
    out_of_vocab = [10, 11, 10_000_000]
    completions = await asyncio.gather(
        *(engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)),
        engine.generate(too_long, SamplingParams(max_tokens=4)),
        engine.generate(out_of_vocab, SamplingParams(max_tokens=4)),
    )
    good, long_c, oov_c = completions[:4], completions[4], completions[5]
    for c, sp in zip(good, params, strict=True):
        assert c.error is None, c.error
        assert 1 <= len(c.token_ids) <= sp.max_tokens and len(c.logprobs) == len(c.token_ids), c
        assert c.finish_reason in (StopReason.STOP, StopReason.LENGTH), c
    assert long_c.finish_reason is StopReason.LENGTH and long_c.error, long_c
    assert oov_c.finish_reason is StopReason.ABORT and oov_c.error, oov_c
    results["logprob_gap_max"], results["logprob_gap_mean"] = logprob_gap(model, prompts, params, good)
    assert results["logprob_gap_max"] < 1e-2, results

    # Weights from the learner: after the update the engine's greedy tokens are model_b's.
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    before = await engine.generate(prompts[1], greedy)
    engine.update_weights(model_b.state_dict().items(), version=1)
    after = await engine.generate(prompts[1], greedy)
    reference = model_b.generate(
        torch.tensor([prompts[1]]), do_sample=False, max_new_tokens=16, min_new_tokens=16
    )[0, len(prompts[1]) :].tolist()
    change = max(abs(a - b) for a, b in zip(before.logprobs, after.logprobs, strict=True))
    assert change > 1e-3, ("update_weights changed nothing", before, after)
    assert list(after.token_ids) == reference[: len(after.token_ids)], (after.token_ids, reference)
    results["after_update_logprob_gap_max"], _ = logprob_gap(model_b, [prompts[1]], [greedy], [after])
    assert results["after_update_logprob_gap_max"] < 1e-2, results
    return results


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        path_a = save_tiny_checkpoint(Path(tmp) / "a", seed=0)
        path_b = save_tiny_checkpoint(Path(tmp) / "b", seed=1)
        model = AutoModelForCausalLM.from_pretrained(path_a, dtype=torch.float32).eval()
        model_b = AutoModelForCausalLM.from_pretrained(path_b, dtype=torch.float32).eval()
        max_context = 256
        engine = VLLMEngine(
            path_a,
            dtype="float32",
            max_model_len=max_context,
            enforce_eager=True,
            kv_cache_memory_bytes=128 << 20,
        )
        results = asyncio.run(run_checks(engine, model, model_b, max_context))
    print("RESULT " + json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
