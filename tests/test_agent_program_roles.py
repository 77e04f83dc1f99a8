"""Agent programs of several roles (issue 50): the request's ``model`` names the role of each call.

Through the real gateway and the real ``openai`` / ``anthropic`` clients: each call of a role is a
step of that role's trajectory, sampled with that role's policy (``SamplingParams.role``); a model
that is not a role is a clean 404 listing the roles; the outcome is the team's, or one per role."""

from __future__ import annotations

import asyncio
import inspect
import re
import sys
import types
from pathlib import Path

import anthropic
import openai
import pytest
import torch
import yaml
from doubles import ScriptedEngine

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.envs.base import EnvKwargsError
from agent_r1.envs.gateway import Gateway, engine_sampler, exact_fraction
from agent_r1.flows.base import AgentEnvLoop
from agent_r1.rollout.hf import HFEngine
from agent_r1.train.backends import LocalRollout
from agent_r1.train.config import config_from_dict
from agent_r1.train.evaluation import evaluate_rollouts
from agent_r1.train.sft import replay_demonstrations, sft_sequences
from agent_r1.train.trainer import Trainer
from agent_r1.types import SamplingParams, TrajectoryStatus

TASK = {"id": "t", "prompt": "Plan, then do."}
ROLES = ["planner", "executor"]


def run(tokenizer, script, agent, *, roles=ROLES, **env_kwargs):
    """One episode of ``agent`` through the loop; the engine double records each request's role."""
    engine = ScriptedEngine(tokenizer, script)
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tokenizer, agent, roles=roles, **env_kwargs),
        tokenizer,
        SamplingParams(max_tokens=64),
    )
    return asyncio.run(loop.run(engine, TASK)), [params.role for _, params in engine.calls]


async def plan_execute_plan(task, client, reward=1.0) -> AgentResult:
    """The planner plans, the executor acts on the plan, the planner checks the result (continuing its
    own conversation, so its second call extends its first)."""
    plan = [{"role": "user", "content": task["prompt"]}]
    first = (await client.chat.completions.create(model="planner", messages=plan)).choices[0].message
    act = [{"role": "user", "content": f"Do this: {first.content}"}]
    done = (await client.chat.completions.create(model="executor", messages=act)).choices[0].message
    plan += [first.model_dump(exclude_none=True), {"role": "user", "content": f"Result: {done.content}"}]
    check = await client.chat.completions.create(model="planner", messages=plan)
    return AgentResult(reward=reward, answer=check.choices[0].message.content)


async def per_role(task, client) -> AgentResult:
    return await plan_execute_plan(task, client, reward={"planner": 1.0, "executor": 0.5})


def test_each_call_is_a_step_of_the_role_its_model_names(tiny_tokenizer):
    (planner, executor), roles = run(tiny_tokenizer, ["plan", "did it", "checked"], plan_execute_plan)
    assert roles == ["planner", "executor", "planner"]  # each request sampled by its role's policy
    assert (planner.role, executor.role) == ("planner", "executor")
    assert [s.response_text for s in planner.steps] == ["plan<|im_end|>", "checked<|im_end|>"]
    assert [s.response_text for s in executor.steps] == ["did it<|im_end|>"]
    assert [s.info["gateway"]["call"] for s in planner.steps] == [0, 2]
    assert "Do this: plan" in tiny_tokenizer.decode(list(executor.steps[0].prompt_ids))
    # the planner's second call extends its first, exactly: each role is judged from its own first call
    assert planner.steps[1].info["gateway"]["prompt"] == "extends"
    assert planner.steps[1].info["gateway"]["extends_call"] == 0
    assert planner.steps[1].info["exact_fraction"] == 1.0
    assert all(t.status is TrajectoryStatus.OK for t in (planner, executor))
    assert planner.outcome_reward == executor.outcome_reward == 1.0  # a number is the team's outcome
    assert planner.info["success"] is True


def test_a_reward_per_role_is_each_roles_outcome(tiny_tokenizer):
    (planner, executor), _ = run(tiny_tokenizer, ["plan", "did it", "checked"], per_role)
    assert (planner.outcome_reward, executor.outcome_reward) == (1.0, 0.5)
    assert planner.info["success"] is False  # every role's reward must reach success_threshold


async def planner_only(task, client) -> dict:
    await client.chat.completions.create(model="planner", messages=[{"role": "user", "content": "hi"}])
    return {"planner": 1.0}  # a bare mapping is a reward per role too; the executor never acted


def test_a_role_that_was_never_called_has_no_trajectory(tiny_tokenizer):
    (planner,), _ = run(tiny_tokenizer, ["plan"], planner_only)
    assert planner.role == "planner" and planner.outcome_reward == 1.0 and len(planner.steps) == 1


async def asks_a_stranger(task, client) -> AgentResult:
    """Calls a model that is not a role: the client raises NotFoundError; the agent carries on."""
    try:
        await client.chat.completions.create(model="critic", messages=[{"role": "user", "content": "hi"}])
    except openai.NotFoundError as error:
        refused = error.message
    models = [m.id async for m in client.models.list()]
    await client.chat.completions.create(model="executor", messages=[{"role": "user", "content": "hi"}])
    return AgentResult(reward=1.0, info={"refused": refused, "models": models})


def test_a_model_that_is_not_a_role_is_a_clean_not_found(tiny_tokenizer):
    (executor,), roles = run(tiny_tokenizer, ["ok"], asks_a_stranger)
    assert roles == ["executor"]  # the refused request was never sampled
    info = executor.steps[-1].info
    assert "'critic'" in info["refused"] and "['planner', 'executor']" in info["refused"]
    assert info["models"] == ROLES
    assert executor.steps[0].info["gateway"]["call"] == 0  # and took no call number


@pytest.mark.parametrize(
    ("reward", "words"),
    [
        ({"planner": 1.0}, r"has none for \['executor'\], which it called"),
        ({"planner": 1.0, "executor": 1.0, "critic": 0.0}, "names 'critic', not one of the roles"),
        ({"planner": 1.0, "executor": "good"}, "for role 'executor' must be a number"),
    ],
)
def test_a_bad_reward_per_role_is_an_error_trajectory_that_says_why(tiny_tokenizer, reward, words):
    async def agent(task, client):
        return await plan_execute_plan(task, client, reward=reward)

    trajectories, _ = run(tiny_tokenizer, ["plan", "did it", "checked"], agent)
    assert all(t.status is TrajectoryStatus.ERROR for t in trajectories)
    assert re.search(words, trajectories[0].error), trajectories[0].error


def test_one_role_is_unchanged_and_refuses_a_reward_per_role(tiny_tokenizer):
    trajectory, roles = run(tiny_tokenizer, ["plan", "did it", "checked"], plan_execute_plan, roles=None)
    assert trajectory.role is None and roles == [None, None, None] and len(trajectory.steps) == 3
    assert trajectory.outcome_reward == 1.0  # any model name is accepted: planner, executor alike
    refused, _ = run(tiny_tokenizer, ["plan", "did it", "checked"], per_role, roles=None)
    assert refused.status is TrajectoryStatus.ERROR and "set env.kwargs.roles" in refused.error


@pytest.mark.parametrize(
    ("roles", "words"),
    [
        ("planner", "must be a list of role names"),
        ([], "must be a list of role names"),
        (["planner", ""], "non-empty strings"),
        (["planner", 3], "non-empty strings"),
        (["planner", "executor", "planner"], r"distinct; \['planner'\] named more than once"),
    ],
)
def test_check_kwargs_refuses_bad_roles_by_key(roles, words):
    kwargs = {"agent": "test_agent_program_roles:plan_execute_plan", "roles": roles}
    with pytest.raises(EnvKwargsError, match=words) as error:
        AgentProgramEnv.check_kwargs(kwargs)
    assert error.value.key == "roles"
    AgentProgramEnv.check_kwargs({**kwargs, "roles": ROLES})


def test_a_standalone_gateway_samples_each_role_in_both_dialects(tiny_tokenizer):
    """Over an engine (no trainer): the role reaches the engine's SamplingParams and the record; the
    answer names it as its model; a stranger is 404 in each API's error shape."""
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "ok")

    async def main():
        async with Gateway(tiny_tokenizer, engine_sampler(engine), roles=ROLES) as gateway:
            session = gateway.open_session()
            oai = openai.AsyncOpenAI(base_url=session.base_url, api_key=session.api_key, max_retries=0)
            ant = anthropic.AsyncAnthropic(
                base_url=session.anthropic_base_url, api_key=session.api_key, max_retries=0
            )
            hi = [{"role": "user", "content": "hi"}]
            answer = await oai.chat.completions.create(model="planner", messages=hi)
            reply = await ant.messages.create(model="executor", max_tokens=8, messages=hi)
            with pytest.raises(openai.NotFoundError) as oai_refused:
                await oai.responses.create(model="gpt-4o", input="hi")
            with pytest.raises(anthropic.NotFoundError) as ant_refused:
                await ant.messages.create(model="claude", max_tokens=8, messages=hi)
            await oai.close()
            await ant.close()
            return answer, reply, oai_refused.value, ant_refused.value, session.records

    answer, reply, oai_refused, ant_refused, records = asyncio.run(main())
    assert (answer.model, reply.model) == ("planner", "executor")
    assert [params.role for _, params in engine.calls] == ["planner", "executor"]
    assert [r.role for r in records] == ["planner", "executor"]
    assert oai_refused.body["param"] == "model" and "['planner', 'executor']" in oai_refused.message
    assert ant_refused.body["error"]["type"] == "not_found_error" and "'claude'" in ant_refused.message
    assert exact_fraction(records) == 1.0  # each role's first call starts its own trajectory


# ----------------------------------------------------------- evaluation and the warm start


def plan_execute_script(prompt: str) -> str:
    """The engine double's answer to each of ``plan_execute_plan``'s calls, read from its prompt."""
    if "Result:" in prompt:
        return "checked"
    return "did it" if "Do this:" in prompt else "plan"


def test_evaluation_counts_an_episode_of_two_roles_once(tiny_tokenizer):
    """``eval/episodes`` is tasks x eval_n: an episode of two roles is one episode and two
    trajectories (``eval/trajectories``), whichever of its roles the mean reward is over."""
    flow = AgentEnvLoop(
        lambda: AgentProgramEnv(tiny_tokenizer, plan_execute_plan, roles=ROLES),
        tiny_tokenizer,
        SamplingParams(max_tokens=64),
    )
    engine = ScriptedEngine(tiny_tokenizer, plan_execute_script)
    rollouts = LocalRollout(engine, flow, flow, shares_model=True)
    tasks = [{"id": f"t{i}", "prompt": f"Plan {i}, then do."} for i in range(3)]
    try:
        metrics = evaluate_rollouts(rollouts, tasks, config_from_dict({"rollout": {"eval_n": 2}}), 0)
    finally:
        rollouts.close()
    assert len(engine.calls) == 3 * 2 * 3  # tasks x eval_n episodes of three calls
    assert (metrics["eval/tasks"], metrics["eval/episodes"], metrics["eval/trajectories"]) == (
        3,
        3 * 2,
        3 * 2 * 2,
    )
    assert metrics["eval/reward"] == metrics["eval/success"] == 1.0 and metrics["eval/error_fraction"] == 0.0


def test_a_replayed_demonstration_of_two_roles_is_one_trajectory_per_role(tiny_tokenizer):
    """A warm start's demonstrations are split by role as the rollout splits an episode: the same
    roles, prompts, response tokens and outcomes as the loop sampling the same responses."""
    responses = ["plan", "did it", "checked"]
    tasks = [{"id": f"t{i}", "prompt": f"Plan {i}, then do."} for i in range(2)]

    def env():
        return AgentProgramEnv(tiny_tokenizer, per_role, roles=ROLES)

    demos = replay_demonstrations(env, tiny_tokenizer, tasks, lambda task, rng: responses)
    assert [(d.task_id, d.role, len(d.steps)) for d in demos] == [
        ("t0", "planner", 2),
        ("t0", "executor", 1),
        ("t1", "planner", 2),
        ("t1", "executor", 1),
    ]
    assert [d.outcome_reward for d in demos] == [1.0, 0.5, 1.0, 0.5]  # each role's own outcome
    loop = AgentEnvLoop(env, tiny_tokenizer, SamplingParams(max_tokens=64))
    sampled = asyncio.run(loop.run(ScriptedEngine(tiny_tokenizer, responses), tasks[0]))
    for demo, rolled in zip(demos[:2], sampled, strict=True):
        assert demo.role == rolled.role and demo.outcome_reward == rolled.outcome_reward
        assert demo.info["success"] == rolled.info["success"]
        assert [(list(s.prompt_ids), list(s.response_ids)) for s in demo.steps] == [
            (list(s.prompt_ids), list(s.response_ids)) for s in rolled.steps
        ]
    assert len(sft_sequences(demos)) == 4  # one sequence per role's trajectory


# ----------------------------------------------------------------------- the Agents SDK: a handoff

HANDOFF = '<tool_call>{"name": "transfer_to_executor", "arguments": {}}</tool_call>'
MULTIPLY = '<tool_call>{"name": "multiply", "arguments": {"a": 6, "b": 7}}</tool_call>'


async def sdk_handoff(task, client) -> AgentResult:
    """Two Agents SDK agents, one model name (role) each: the planner hands off to the executor."""
    import agents
    from test_gateway_agents_sdk import multiply  # the SDK tool the other SDK tests use

    def model(role: str):
        return agents.OpenAIChatCompletionsModel(model=role, openai_client=client)

    executor = agents.Agent(
        name="executor", instructions="Compute.", tools=[multiply], model=model("executor")
    )
    planner = agents.Agent(
        name="planner", instructions="Hand the work over.", handoffs=[executor], model=model("planner")
    )
    result = await agents.Runner.run(
        planner, task["prompt"], run_config=agents.RunConfig(tracing_disabled=True)
    )
    return AgentResult(reward=float(result.final_output.strip() == "42"), answer=result.final_output)


def test_two_agents_sdk_agents_hand_off_and_each_is_a_role(tiny_tokenizer):
    pytest.importorskip("agents")
    (planner, executor), roles = run(tiny_tokenizer, [HANDOFF, MULTIPLY, "42"], sdk_handoff)
    assert roles == ["planner", "executor", "executor"]
    assert [len(planner.steps), len(executor.steps)] == [1, 2]
    assert planner.steps[0].info["gateway"]["tool_calls"] == 1  # the handoff is the planner's tool call
    assert "<tool_response>\n42\n</tool_response>" in tiny_tokenizer.decode(
        list(executor.steps[1].prompt_ids)
    )
    assert executor.steps[1].info["gateway"]["prompt"] == "extends"
    assert planner.outcome_reward == executor.outcome_reward == 1.0


# ----------------------------------------------------------------------- LangGraph: two model nodes


async def langgraph_team(task, client) -> AgentResult:
    """A LangGraph graph of two model nodes, one ``ChatOpenAI`` each named by its role: the planner
    writes a plan, the executor acts on it."""
    import httpx
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI
    from langgraph.graph import END, START, MessagesState, StateGraph

    http = httpx.AsyncClient(timeout=None)  # closed with the episode (examples/langgraph_agent.py)

    def chat(role: str) -> ChatOpenAI:
        base_url, key = str(client.base_url), client.api_key
        return ChatOpenAI(model=role, base_url=base_url, api_key=key, max_retries=0, http_async_client=http)

    planner, executor = chat("planner"), chat("executor")

    async def plan(state: MessagesState) -> dict:
        return {"messages": [await planner.ainvoke(state["messages"])]}

    async def act(state: MessagesState) -> dict:
        order = HumanMessage(f"Do this: {state['messages'][-1].content}")
        return {"messages": [await executor.ainvoke([order])]}

    graph = StateGraph(MessagesState)
    graph.add_node("plan", plan)
    graph.add_node("act", act)
    graph.add_edge(START, "plan")
    graph.add_edge("plan", "act")
    graph.add_edge("act", END)
    try:
        state = await graph.compile().ainvoke({"messages": [HumanMessage(task["prompt"])]})
    finally:
        await http.aclose()
    return AgentResult(reward=1.0, answer=state["messages"][-1].content)


def test_a_langgraph_graph_of_two_model_nodes_is_a_trajectory_per_role(tiny_tokenizer):
    pytest.importorskip("langgraph")
    (planner, executor), roles = run(tiny_tokenizer, ["step one", "done"], langgraph_team)
    assert roles == ["planner", "executor"]
    assert [len(planner.steps), len(executor.steps)] == [1, 1]
    assert "Do this: step one" in tiny_tokenizer.decode(list(executor.steps[0].prompt_ids))
    assert "Plan, then do." in tiny_tokenizer.decode(list(planner.steps[0].prompt_ids))
    assert planner.outcome_reward == executor.outcome_reward == 1.0


# ----------------------------------------------------------------------- training: a policy per role


def ascii_share(text: str | None) -> float:
    """A dense reward for a random tiny model: the share of ASCII characters in a reply."""
    return sum(ch.isascii() for ch in text or "") / max(len(text or ""), 1)


async def scored_roles(task, client) -> AgentResult:
    """A planner call and an executor call, each role scored on its own reply."""
    ask = [{"role": "user", "content": task["prompt"]}]
    plan = (await client.chat.completions.create(model="planner", messages=ask)).choices[0].message
    act = [{"role": "user", "content": f"Do this: {plan.content}"}]
    done = (await client.chat.completions.create(model="executor", messages=act)).choices[0].message
    return AgentResult(reward={"planner": ascii_share(plan.content), "executor": ascii_share(done.content)})


@pytest.mark.skipif(
    "roles" not in inspect.signature(HFEngine).parameters,
    reason="needs HFEngine(roles=...), the engine serving one adapter per role (branch engine-roles)",
)
def test_each_role_trains_its_own_adapter(tiny_checkpoint, tmp_path):
    """The planner and the executor are two LoRA adapters on the tiny model (``policies:``); one run
    trains both, each from its own role's calls."""
    config = config_from_dict(
        {
            "model": {"path": str(tiny_checkpoint), "lora": {"rank": 4, "alpha": 8}},
            "env": {
                "name": "agent_program",
                "kwargs": {"agent": "test_agent_program_roles:scored_roles", "roles": ROLES},
            },
            "rollout": {"n": 4, "max_tokens": 6, "max_steps": 2},
            "trainer": {
                "steps": 1,
                "tasks_per_step": 2,
                "lr": 1e-2,
                "run_dir": str(tmp_path),
                "eval_every": 0,
            },
            "logging": {"progress": False, "tensorboard": False},
            "policies": {"planner": {}, "executor": {}},
        }
    )
    trainer = Trainer(config, train_tasks=[{"id": f"t{i}", "prompt": f"Plan {i}."} for i in range(2)])

    def adapter(name):
        return {
            n: p.detach().clone()
            for n, p in trainer.model.named_parameters()
            if f".{name}." in n and "lora_B" in n
        }

    before = {name: adapter(name) for name in ROLES}
    metrics = trainer.fit()
    for name in ROLES:
        assert f"role/{name}/reward/mean" in metrics and f"policy/{name}/loss/policy" in metrics
        assert any(not torch.equal(p, before[name][n]) for n, p in adapter(name).items()), name


def test_the_documented_two_role_agent_and_config(tiny_checkpoint, tiny_tokenizer, monkeypatch, tmp_path):
    """docs/gateway.md's "Several roles" example as written: its agent, its env kwargs and policies."""
    docs = (Path(__file__).resolve().parents[1] / "docs" / "gateway.md").read_text()
    section = docs.split("## Several roles", 1)[1].split("\n## ", 1)[0]
    python, config_yaml = re.findall(r"```(?:python|yaml)\n(.*?)```", section, re.S)
    module = types.ModuleType("documented_team")
    exec(python, module.__dict__)
    monkeypatch.setitem(sys.modules, "documented_team", module)
    data = yaml.safe_load(config_yaml.replace("my_pkg.team", "documented_team"))
    data["model"]["path"] = str(tiny_checkpoint)
    config = config_from_dict({**data, "trainer": {"run_dir": str(tmp_path)}})
    assert list(config.policies) == ROLES and config.policies["executor"].lr == 5e-5
    AgentProgramEnv.check_kwargs(config.env.kwargs)
    engine = ScriptedEngine(tiny_tokenizer, ["plan", "did it", "It is 27."])
    loop = AgentEnvLoop(
        lambda: AgentProgramEnv(tiny_tokenizer, **config.env.kwargs), tiny_tokenizer, SamplingParams()
    )
    planner, executor = asyncio.run(loop.run(engine, {"id": "t", "prompt": "3 * 9?", "answer": "27"}))
    assert [planner.role, executor.role] == ROLES and [len(planner.steps), len(executor.steps)] == [2, 1]
    assert planner.outcome_reward == executor.outcome_reward == 1.0
