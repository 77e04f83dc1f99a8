"""On-policy distillation (``algorithm.distill``): the per-token reverse-KL advantage by hand, the
teacher's log-probs in every layout and from a server, a tiny run whose reverse KL falls, and the
errors a bad teacher gets at start."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest
import torch
from aiohttp import web
from trainer_envs import tasks

from agent_r1.algos import distill_advantages
from agent_r1.models.tiny import build_tiny_tokenizer, save_tiny_checkpoint
from agent_r1.train import phases, teacher
from agent_r1.train.config import ConfigError, config_from_dict
from agent_r1.train.trainer import Trainer


def _config(student, run_dir, **sections):
    data = {
        "model": {"path": str(student)},
        "env": {"name": "trainer_envs:LowByteEnv"},
        "rollout": {"n": 2, "max_tokens": 8, "max_steps": 2},
        "trainer": {
            "steps": 2,
            "tasks_per_step": 2,
            "lr": 3e-3,
            "run_dir": str(run_dir),
            "mini_batches": 1,
        },
        "logging": {"progress": False, "tensorboard": False, "dump_trajectories": False},
    }
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return config_from_dict(data)


@pytest.fixture(scope="module")
def teacher_checkpoint(tmp_path_factory, tiny_tokenizer):
    """Another architecture and size (Qwen3, 2 layers) with the student's tokenizer."""
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("teacher") / "model",
        seed=7,
        tokenizer=tiny_tokenizer,
        architecture="qwen3",
        num_layers=2,
        hidden_size=64,
    )


# ------------------------------------------------------------------ the signal, by hand


def test_distill_advantage_by_hand():
    advantages_T = torch.tensor([0.5, 0.5, 0.0, -1.0])
    student_T = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    teacher_T = torch.tensor([-1.5, -1.0, -9.0, -3.0])
    mask_T = torch.tensor([1.0, 1.0, 0.0, 1.0])  # token 2 is forced (not the model's): never scored
    out_T, rkl_T = distill_advantages(advantages_T, student_T, teacher_T, mask_T, coef=2.0, reward_weight=0.5)
    # rkl = student - teacher = [0.5, -1.0, (8.5 masked) 0, 0.0]
    assert rkl_T.tolist() == [0.5, -1.0, 0.0, 0.0]
    # A = 0.5 * A_env - 2 * rkl = [0.25 - 1, 0.25 + 2, 0, -0.5 - 0]
    assert out_T.tolist() == [-0.75, 2.25, 0.0, -0.5]


def test_distill_term_is_added_after_the_group_normalisation():
    """GRPO normalises the env's rewards within the group; the KL term is added afterwards, so it
    keeps its own scale (nats per token) whatever the group's reward spread."""
    grpo_T = torch.tensor([0.7071, 0.7071, -0.7071, -0.7071])
    student_T = torch.tensor([-1.0, -2.0, -1.0, -0.5])
    teacher_T = student_T + torch.tensor([0.25, -0.5, 0.0, 1.0])  # rkl = [-0.25, 0.5, 0, -1]
    out_T, _ = distill_advantages(grpo_T, student_T, teacher_T, torch.ones(4), coef=1.0, reward_weight=1.0)
    assert torch.allclose(out_T, grpo_T + torch.tensor([0.25, -0.5, 0.0, 1.0]), atol=0, rtol=0)


# ------------------------------------------------------------------ the teacher's log-probs


def _per_step_teacher_logprobs(teacher_model, batch) -> torch.Tensor:
    """Each step alone, one row: prompt + response through the teacher, the response's log-probs
    under log softmax(logits) (the reference computation, independent of packing and tries)."""
    out_T = torch.zeros(batch.num_tokens)
    with torch.no_grad():
        for step, offset in zip(batch.rows.steps, batch.rows.offsets, strict=True):
            ids = list(step.prompt_ids) + list(step.response_ids)
            logits_TV = teacher_model(input_ids=torch.tensor([ids])).logits[0].float()
            logprobs_TV = torch.log_softmax(logits_TV, -1)
            n, p = len(step.response_ids), len(step.prompt_ids)
            positions = torch.arange(p - 1, p - 1 + n)
            out_T[offset : offset + n] = logprobs_TV[positions, torch.tensor(step.response_ids)]
    return out_T


# fp32 throughout. The packed/trie forward and the one-row forward compute the same sums in other
# orders (SDPA by segments vs whole rows, other matmul shapes): each op's rounding is ~6e-8 relative,
# accumulated over reductions of at most a few hundred terms (hidden 64, intermediate 384, <= 300
# positions, 270-way log-softmax) on values of magnitude <= ~10: well under 1e-4 absolute.
LOGPROB_ATOL = 1e-4


@pytest.fixture(scope="module")
def distill_step(tiny_checkpoint, teacher_checkpoint, tmp_path_factory):
    """One step's phases up to the distillation term, with a two-turn env whose second prompt
    extends the first (the steps share one sequence: a prefix trie with the group's prompt)."""
    config = _config(
        tiny_checkpoint,
        tmp_path_factory.mktemp("run"),
        algorithm={"distill": {"teacher": str(teacher_checkpoint), "coef": 0.5, "reward_weight": 1.0}},
        rollout={"n": 3},
    )
    trainer = Trainer(config, train_tasks=tasks(4))
    groups = trainer.rollout(tasks(2), 1)
    kept, _ = trainer.filter(groups)
    context = trainer.context(1)
    batch, _ = phases.advantages(trainer.batch(kept, 1), context)
    distilled, metrics = teacher.distill(batch, context)
    return trainer, batch, distilled, metrics


def test_teacher_scores_the_packed_layout_like_each_step_alone(distill_step):
    trainer, batch, distilled, _ = distill_step
    assert any(mb.segments is not None or mb.visible_until_BT is not None for mb in batch.all_micro_batches)
    expected_T = _per_step_teacher_logprobs(trainer.learner.teacher.model, batch)
    got_T = distilled.tokens.teacher_logprobs
    assert got_T.shape == (batch.num_tokens,)
    assert (got_T - expected_T).abs().max() < LOGPROB_ATOL


def test_distilled_advantage_is_the_estimator_plus_the_scaled_reverse_kl(distill_step):
    _, batch, distilled, metrics = distill_step
    tokens = distilled.tokens
    rkl_T = (tokens.sampler_logprobs - tokens.teacher_logprobs) * tokens.mask
    expected_T = (1.0 * batch.tokens.advantages - 0.5 * rkl_T) * tokens.mask
    assert torch.equal(tokens.advantages, expected_T)
    assert metrics["distill/reverse_kl"] == pytest.approx(float(rkl_T.sum() / tokens.mask.sum()), rel=1e-6)
    # tokens the model did not generate (mask 0) get no advantage at all
    assert torch.all(tokens.advantages[tokens.mask == 0] == 0)


class _ServerThread:
    """``agent-r1 serve``'s app over an engine, on an event loop of its own thread (the trainer's
    server teacher calls it synchronously from this one)."""

    def __init__(self, app: web.Application) -> None:
        from agent_r1.rollout.server import start_server

        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner, port = asyncio.run_coroutine_threadsafe(start_server(app), self.loop).result()
        self.url = f"http://127.0.0.1:{port}/v1"

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def test_server_teacher_gives_the_local_teachers_log_probs(distill_step, teacher_checkpoint):
    """``agent-r1 serve`` over the same weights, asked with vLLM's prompt_logprobs per step."""
    from agent_r1.rollout import HFEngine
    from agent_r1.rollout.server import build_app
    from agent_r1.train.teacher import check_teacher, server_teacher_logprobs

    trainer, batch, distilled, _ = distill_step
    engine = HFEngine.from_pretrained(str(teacher_checkpoint), dtype=torch.float32)
    server = _ServerThread(build_app(engine, model_name="teacher", tokenizer=engine.tokenizer, api_key="k3y"))
    try:
        config = config_from_dict(
            {"algorithm": {"distill": {"teacher": server.url, "api_key_env": "TEACHER_KEY"}}}
        )
        import os

        os.environ["TEACHER_KEY"] = "k3y"
        check_teacher(config, trainer.tokenizer)
        remote_T = server_teacher_logprobs(
            config.algorithm.distill, batch.rows.steps, batch.rows.offsets, batch.num_tokens
        )
    finally:
        server.close()
        engine.close()
    # one row per step on the server vs the packed layout here: the same bound as above
    assert (remote_T - distilled.tokens.teacher_logprobs).abs().max() < LOGPROB_ATOL


@pytest.mark.parametrize(
    "context",
    [
        {"context": "append"},
        {"context": "rerender"},
        {"context": "sliding_window", "context_kwargs": {"k": 1}},
        {"context": "summarize", "context_kwargs": {"keep_last": 1, "max_turns": 1}},
    ],
    ids=lambda c: c["context"],
)
def test_teacher_scores_each_steps_own_prompt_under_every_context_policy(
    context, tiny_checkpoint, teacher_checkpoint, tmp_path
):
    """Steps whose prompts do not extend the previous step (rerender, a window, a summary) are their
    own sequences; those that do share one. Either way each response token is scored given its own
    step's prompt."""
    config = _config(
        tiny_checkpoint,
        tmp_path,
        env={"name": "trainer_envs:echo_env", "kwargs": {**context, "max_turns": 3}},
        rollout={"n": 2, "max_tokens": 6, "max_steps": 3},
        algorithm={"distill": {"teacher": str(teacher_checkpoint)}},
    )
    trainer = Trainer(config, train_tasks=tasks(2))
    try:
        groups = trainer.rollout(tasks(2), 1)
        context = trainer.context(1)
        batch, _ = phases.advantages(trainer.batch(trainer.filter(groups)[0], 1), context)
        assert max(len(t.steps) for t in batch.trajectories) >= 3  # summarize adds its summary step
        distilled, _ = teacher.distill(batch, context)
        expected_T = _per_step_teacher_logprobs(trainer.learner.teacher.model, batch)
    finally:
        trainer.close()
    assert (distilled.tokens.teacher_logprobs - expected_T).abs().max() < LOGPROB_ATOL


@pytest.mark.parametrize(
    "mode",
    [
        {"model": {"lora": {"rank": 4}}},
        {
            "trainer": {"mode": "async"},
            "rollout": {"share_model": False},
            "algorithm": {"old_logprobs": "sampler"},
        },
    ],
    ids=["lora_student", "async"],
)
def test_distillation_trains_a_lora_student_and_in_async_mode(
    mode, tiny_checkpoint, teacher_checkpoint, tmp_path
):
    """A LoRA student (the teacher is its own model, not the adapter-disabled policy) and async mode
    (each step's sampler log-probs are those of the policy version that sampled it, so the reverse KL
    is that version's): three steps train, each logging the reverse KL and the teacher's time."""
    sections = {key: dict(value) for key, value in mode.items()}
    sections["algorithm"] = {**sections.get("algorithm", {}), "distill": {"teacher": str(teacher_checkpoint)}}
    sections["trainer"] = {**sections.get("trainer", {}), "steps": 3}
    trainer = Trainer(_config(tiny_checkpoint, tmp_path, **sections), train_tasks=tasks(8))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.fit()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "distill/reverse_kl" in r]
    assert [r["step"] for r in trained] == [1, 2, 3]
    assert all(r["time/teacher"] > 0 for r in trained)
    changed = [
        n for n, p in trainer.model.named_parameters() if n in before and not torch.equal(p, before[n])
    ]
    assert changed and (not mode.get("model") or all("lora_" in n for n in changed))


def test_serve_answers_prompt_logprobs_in_vllms_shape(tiny_checkpoint, tiny_tokenizer):
    """``prompt_logprobs: k``: None first, then per token a mapping holding the prompt token (with its
    rank) and the k most likely, ranks 1..k, under the model's log softmax; k < 0 is HTTP 400."""
    import aiohttp

    from agent_r1.rollout import HFEngine
    from agent_r1.rollout.server import build_app

    engine = HFEngine.from_pretrained(str(tiny_checkpoint), dtype=torch.float32)
    server = _ServerThread(build_app(engine, model_name="tiny", tokenizer=tiny_tokenizer))
    prompt = [40, 41, 42, 43, 44]

    async def ask(k):
        async with aiohttp.ClientSession() as http:
            body = {
                "prompt": prompt,
                "max_tokens": 1,
                "prompt_logprobs": k,
                "return_tokens_as_token_ids": True,
            }
            response = await http.post(f"{server.url}/completions", json=body)
            return response.status, await response.json()

    try:
        status, answer = asyncio.run(ask(2))
        bad_status, bad = asyncio.run(ask(-1))
    finally:
        server.close()
        engine.close()
    assert status == 200
    entries = answer["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(prompt)
    with torch.no_grad():
        logprobs_TV = torch.log_softmax(
            engine.model(input_ids=torch.tensor([prompt])).logits[0, :-1].float(), -1
        )
    for t, entry in enumerate(entries[1:]):
        own = entry[str(prompt[t + 1])]
        assert abs(own["logprob"] - float(logprobs_TV[t, prompt[t + 1]])) < LOGPROB_ATOL
        assert own["rank"] == int((logprobs_TV[t] > logprobs_TV[t, prompt[t + 1]]).sum()) + 1
        assert own["decoded_token"] == f"token_id:{prompt[t + 1]}"
        top = sorted((v["rank"], int(i)) for i, v in entry.items() if v["rank"] <= 2)
        assert [i for _, i in top] == logprobs_TV[t].topk(2).indices.tolist()
    assert bad_status == 400 and "prompt_logprobs" in bad["error"]["message"]


# ------------------------------------------------------------------ learning


def test_distillation_alone_lowers_the_reverse_kl(tiny_checkpoint, tmp_path):
    """Teacher: the student after 6 RL steps on the env (a policy that prefers low bytes), as in the
    recipe (an RL-trained teacher, a fresh student). Distillation alone (no reward) brings the
    student's per-token reverse KL to it down: to under a third over 12 steps, falling step after
    step."""
    teacher_config = _config(
        tiny_checkpoint,
        tmp_path / "teacher",
        rollout={"n": 4},
        trainer={"steps": 6, "tasks_per_step": 4, "lr": 1e-2},
    )
    Trainer(teacher_config, train_tasks=tasks(24)).fit()
    config = _config(
        tiny_checkpoint,
        tmp_path / "run",
        algorithm={
            "distill": {"teacher": str(tmp_path / "teacher" / "checkpoints" / "step_000006" / "model")}
        },
        rollout={"n": 4},
        trainer={"steps": 12, "tasks_per_step": 4, "lr": 3e-3},
    )
    Trainer(config, train_tasks=tasks(32)).fit()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    rkl = [r["distill/reverse_kl"] for r in rows if "distill/reverse_kl" in r]
    assert len(rkl) == 12 and all("time/teacher" in r for r in rows if "distill/reverse_kl" in r)
    assert sum(rkl[-2:]) / 2 < 0.3 * sum(rkl[:2]) / 2, rkl
    assert sum(b < a for a, b in zip(rkl, rkl[1:], strict=False)) >= 9, rkl  # a trend, not one lucky step


# ------------------------------------------------------------------ bad input, at start


def test_missing_teacher_folder_is_one_error_naming_the_key(tiny_checkpoint, tmp_path):
    config = _config(tiny_checkpoint, tmp_path, algorithm={"distill": {"teacher": str(tmp_path / "nope")}})
    with pytest.raises(ConfigError, match=r"'algorithm\.distill\.teacher'.*is not a folder"):
        Trainer(config, train_tasks=tasks(2))


def test_teacher_with_another_tokenizer_is_refused_saying_what_differs(tiny_checkpoint, tmp_path):
    other = build_tiny_tokenizer(chat_template="{{ messages }}", extra_special_tokens=("<think>",))
    teacher = save_tiny_checkpoint(tmp_path / "other", tokenizer=other)
    config = _config(tiny_checkpoint, tmp_path / "run", algorithm={"distill": {"teacher": str(teacher)}})
    with pytest.raises(ConfigError) as error:
        Trainer(config, train_tasks=tasks(2))
    message = str(error.value)
    assert "'algorithm.distill.teacher'" in message
    assert "vocabulary" in message and "<think>" in message and "chat template" in message


def test_server_without_prompt_logprobs_is_refused_at_start(tiny_checkpoint, tmp_path):
    """``old_server`` is a test double: an OpenAI-compatible completions endpoint that ignores
    ``prompt_logprobs`` (as servers other than vLLM and agent-r1 serve do)."""

    async def models(request):
        return web.json_response({"object": "list", "data": [{"id": "old"}]})

    async def completions(request):
        body = await request.json()
        return web.json_response(
            {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}], "echo": body}
        )

    old_server = web.Application()
    old_server.router.add_get("/v1/models", models)
    old_server.router.add_post("/v1/completions", completions)
    server = _ServerThread(old_server)
    try:
        config = _config(tiny_checkpoint, tmp_path, algorithm={"distill": {"teacher": server.url}})
        with pytest.raises(ConfigError, match=r"'algorithm\.distill\.teacher'.*no prompt log-probs"):
            Trainer(config, train_tasks=tasks(2))
    finally:
        server.close()


def test_distill_config_errors_name_their_keys():
    with pytest.raises(ConfigError, match="'algorithm.distill.teacher_model'"):
        config_from_dict({"algorithm": {"distill": {"teacher": "/some/folder", "teacher_model": "x"}}})
    with pytest.raises(ConfigError, match="'algorithm.dynamic_filter'"):
        config_from_dict({"algorithm": {"dynamic_filter": True, "distill": {"teacher": "/some/folder"}}})
    with pytest.raises(ConfigError, match="'algorithm.distill.coef'"):
        config_from_dict({"algorithm": {"distill": {"coef": 0}}})
