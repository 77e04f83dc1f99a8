"""LLMJudge against a local served model (``agent-r1 serve``'s app), with retries, timeouts and
failure values."""

from __future__ import annotations

import asyncio

import pytest
import torch
from aiohttp import web
from doubles import ScriptedEngine
from transformers import AutoModelForCausalLM

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.models.tokens import encode_text, render_messages
from agent_r1.rollout import HFEngine
from agent_r1.rollout.judge import LLMJudge
from agent_r1.rollout.server import build_app, start_server
from agent_r1.types import SamplingParams

TASK = {"prompt": "What is 6 * 7?", "answer": "42"}
PROMPT = "Question: {prompt}\nReference: {answer}\nReply: {response}\nScore 0 to 1."


async def serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner, port = await start_server(app)
    return runner, f"http://127.0.0.1:{port}/v1"


def test_judge_scores_through_a_served_model_and_parses_its_reply(tiny_tokenizer):
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "0.75" if "Reply: 42" in prompt else "no idea")

    async def main():
        runner, url = await serve(build_app(engine, model_name="judge", tokenizer=tiny_tokenizer))
        judge = LLMJudge(base_url=url, model="judge", prompt=PROMPT, failure_value=-1.0)
        scores = [
            await judge("42", TASK),
            await judge(AgentResult(answer="42"), TASK),
            await judge("7", TASK),
        ]
        await runner.cleanup()
        return scores

    assert asyncio.run(main()) == [0.75, 0.75, -1.0]  # "no idea" holds no score
    assert "Reference: 42" in tiny_tokenizer.decode(engine.calls[0][0])


def test_judge_retries_server_errors_and_times_out_to_the_failure_value(tiny_tokenizer):
    answers = {"flaky": 0}

    async def flaky(request: web.Request) -> web.Response:
        answers["flaky"] += 1
        if answers["flaky"] == 1:
            return web.json_response({"error": {"message": "busy", "type": "x", "code": 503}}, status=503)
        reply = {"role": "assistant", "content": "1"}
        return web.json_response(
            {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "judge",
                "choices": [{"index": 0, "message": reply, "finish_reason": "stop"}],
            }
        )

    async def stuck(request: web.Request) -> web.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def main():
        app = web.Application()
        app.router.add_post("/flaky/v1/chat/completions", flaky)
        app.router.add_post("/stuck/v1/chat/completions", stuck)
        runner, url = await serve(app)
        base = url.removesuffix("/v1")
        retried = await LLMJudge(base_url=f"{base}/flaky/v1", model="judge", prompt=PROMPT)("42", TASK)
        once = LLMJudge(
            base_url=f"{base}/flaky/v1", model="judge", prompt=PROMPT, retries=0, failure_value=-2.0
        )
        answers["flaky"] = 0
        not_retried = await once("42", TASK)
        timed_out = await LLMJudge(
            base_url=f"{base}/stuck/v1",
            model="judge",
            prompt=PROMPT,
            retries=0,
            timeout_s=0.2,
            failure_value=-3.0,
        )("42", TASK)
        await runner.cleanup()
        return retried, not_retried, timed_out

    assert asyncio.run(main()) == (1.0, -2.0, -3.0)
    with pytest.raises(ValueError, match=r"names \{reference\}"):
        LLMJudge(base_url="http://x/v1", model="m", prompt="{reference}").messages("r", TASK)


async def answers_42(task, client) -> AgentResult:
    r = await client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": task["prompt"]}]
    )
    return AgentResult(answer=r.choices[0].message.content)


def test_a_judge_is_the_reward_of_an_agent_program_with_a_real_served_model(tiny_checkpoint, tiny_tokenizer):
    """The judge is the real tiny model behind agent-r1 serve: its reply is noise, so the score is
    what ``parse`` reads from it — here the reply's length, which a greedy model fixes."""
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    judge_engine = HFEngine(model, tokenizer=tiny_tokenizer, max_context=512)

    async def main():
        runner, url = await serve(build_app(judge_engine, model_name="judge", tokenizer=tiny_tokenizer))
        judge = LLMJudge(
            base_url=url, model="judge", prompt=PROMPT, parse=lambda reply: float(len(reply)), max_tokens=4
        )
        loop = AgentEnvLoop(
            lambda: AgentProgramEnv(tiny_tokenizer, answers_42, reward_fn=judge),
            tiny_tokenizer,
            SamplingParams(),
        )
        trajectory = await loop.run(ScriptedEngine(tiny_tokenizer, ["42"]), TASK)
        direct = await judge("42", TASK)
        await runner.cleanup()
        return trajectory, direct

    trajectory, direct = asyncio.run(main())
    greedy = asyncio.run(
        judge_engine.generate(
            encode_text(
                tiny_tokenizer,
                render_messages(
                    tiny_tokenizer, [{"role": "user", "content": PROMPT.format(**TASK, response="42")}]
                ),
            ),
            SamplingParams(temperature=0.0, max_tokens=4),
        )
    )
    expected = float(len(tiny_tokenizer.decode(list(greedy.token_ids), skip_special_tokens=False)))
    assert trajectory.outcome_reward == direct == expected
