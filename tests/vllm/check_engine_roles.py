"""VLLMEngine serving several roles, run by ``tests/test_rollout_vllm.py`` with ``.venv-vllm/bin/python``.

``check_engine_roles.py MODEL ADAPTERS OUT``: one in-process vLLM engine on the tiny model (fp32, CPU)
serves roles planner -> adapter alpha, executor -> beta, judge -> the base model. ``ADAPTERS`` holds
the folders peft's ``save_pretrained`` wrote (``alpha``, ``beta``, ``beta2``). Before any adapter is
loaded a planner request aborts; then alpha and beta are loaded from their folders and requests of
every role run together (one of an unknown role, one without a role); then beta is replaced by
``beta2``'s weights given as tensors in memory (``LoraWeights``) and the executor samples again.
Writes every completion to ``OUT`` (JSON) for the test to compare with a Hugging Face forward under
each adapter alone (this venv has no peft); exits non-zero on a failed check.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from safetensors.torch import load_file

from agent_r1.rollout.base import LoraWeights
from agent_r1.rollout.vllm_engine import VLLMEngine
from agent_r1.types import SamplingParams, StopReason

ROLES = {"planner": "alpha", "executor": "beta", "judge": None}


def prompt(n: int, start: int = 10) -> list[int]:
    return [start + (i * 7) % 200 for i in range(n)]


def record(phase: str, role: str, prompt_ids, params: SamplingParams, completion) -> dict:
    assert completion.error is None, completion.error
    assert completion.finish_reason in (StopReason.STOP, StopReason.LENGTH), completion
    assert 1 <= len(completion.token_ids) == len(completion.logprobs), completion
    return {
        "phase": phase,
        "role": role,
        "prompt": list(prompt_ids),
        "temperature": params.temperature,
        "token_ids": list(completion.token_ids),
        "logprobs": list(completion.logprobs),
    }


async def run_checks(engine: VLLMEngine, adapters: Path) -> list[dict]:
    shared = prompt(14, 3)
    before = await engine.generate(shared, SamplingParams(max_tokens=4, role="planner"))
    assert before.finish_reason is StopReason.ABORT and "'alpha'" in before.error, before
    assert "no weights yet" in before.error, before

    engine.update_adapters({"alpha": adapters / "alpha", "beta": adapters / "beta"}, version=1)
    assert engine.weight_version == 1
    calls = [
        ("planner", shared, SamplingParams(max_tokens=12, seed=1, role="planner")),
        ("planner", shared, SamplingParams(max_tokens=12, seed=2, role="planner")),
        ("executor", shared, SamplingParams(temperature=0.7, max_tokens=10, seed=3, role="executor")),
        ("executor", prompt(6, 8), SamplingParams(temperature=0.0, max_tokens=9, role="executor")),
        ("judge", prompt(25, 5), SamplingParams(max_tokens=14, seed=5, role="judge")),
    ]
    *served, unknown, no_role = await asyncio.gather(
        *(engine.generate(p, sp) for _, p, sp in calls),
        engine.generate(shared, SamplingParams(max_tokens=4, role="critic")),
        engine.generate(shared, SamplingParams(max_tokens=4)),
    )
    for refused in (unknown, no_role):
        assert refused.finish_reason is StopReason.ABORT and refused.token_ids == (), refused
        assert "['executor', 'judge', 'planner']" in refused.error, refused
    assert "unknown role 'critic'" in unknown.error and "role is None" in no_role.error
    records = [record("v1", role, p, sp, c) for (role, p, sp), c in zip(calls, served, strict=True)]

    # beta's new weights as tensors in memory (what the learner exports), the same prompt again: its
    # KV from the old beta must not be reused (a new LoRA name and path per version)
    folder = adapters / "beta2"
    beta2 = LoraWeights(
        json.loads((folder / "adapter_config.json").read_text()),
        load_file(str(folder / "adapter_model.safetensors")),
    )
    engine.update_weights({"beta": beta2}, version=2)
    assert engine.weight_version == 2
    again = SamplingParams(temperature=0.7, max_tokens=10, seed=3, role="executor")
    replaced = await engine.generate(shared, again)
    records.append(record("v2", "executor", shared, again, replaced))
    try:
        engine.update_adapters({"gamma": folder})
    except ValueError as e:
        assert "not served" in str(e), e
    else:
        raise AssertionError("an adapter that no role uses was loaded")
    return records


def main(model: str, adapters: str, out: str) -> int:
    engine = VLLMEngine(
        model,
        roles=ROLES,
        max_lora_rank=4,  # the adapters' rank: rounded up to vLLM's 8
        dtype="float32",
        max_model_len=256,
        enforce_eager=True,
        kv_cache_memory_bytes=128 << 20,
    )
    records = asyncio.run(run_checks(engine, Path(adapters)))
    Path(out).write_text(json.dumps(records))
    print(f"RESULT {len(records)} completions")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
