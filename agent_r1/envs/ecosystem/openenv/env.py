"""The OpenEnv adapter: an OpenEnv environment as an agent-r1 ``AgentEnv`` (``env.name: openenv``)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

from agent_r1.envs.base import AgentEnv
from agent_r1.envs.context import ContextRequest, PreviousTurn, resolve_context_policy, task_messages
from agent_r1.envs.ecosystem.openenv.errors import ActionRejected, OpenEnvError
from agent_r1.envs.ecosystem.openenv.introspect import (
    HOOK,
    declared_action_class,
    openenv_core,
    resolve,
    text_field,
)
from agent_r1.envs.ecosystem.openenv.server import SERVER_KEYS, LocalServer, action_schema, serves_tools
from agent_r1.envs.ecosystem.openenv.sessions import InProcessSession, RemoteSession, Reply
from agent_r1.envs.ecosystem.openenv.text import default_render_observation, validation_message
from agent_r1.envs.ecosystem.openenv.tools import OpenEnvTool, tool_failed, tool_text
from agent_r1.envs.tool_env import ToolEnv
from agent_r1.models.loading import require_chat_template
from agent_r1.tools import ToolArgumentError
from agent_r1.tools.threads import run_in_daemon_thread
from agent_r1.types import Action, Message, Observation, StepResult, Task

__all__ = ["OpenEnvEnv"]


class OpenEnvEnv(AgentEnv):
    """An OpenEnv environment as an agent-r1 env (``env.name: openenv``); the package docstring for the mapping.

    Config (``env.kwargs``); exactly one of ``environment``, ``server``, ``base_url``:

    - ``environment``: ``"module:Class"``, an OpenEnv ``Environment`` subclass run in this process,
      one instance per trajectory, built with ``environment_kwargs``.
    - ``server``: ``{app: "module:app", cwd: folder the module is imported from (default: the
      working directory), env: {VAR: value} for the server process, startup_timeout_s: 180}``; the
      adapter starts uvicorn on 127.0.0.1 at a free port, once per process and app.
    - ``base_url``: ``"http://host:port"`` of a server already running.
    - ``client``: ``"module:Class"``, the environment's own ``EnvClient`` subclass (typed
      observations); default OpenEnv's ``GenericEnvClient`` (dict observations), or
      ``MCPToolClient`` for a tool environment.
    - ``action``: ``"module:Class"``, the environment's Action class; default: the one the
      environment class (or ``client``) declares, else (a served environment) its published
      ``/schema``.
    - ``render_observation``: observation -> text, a ``"module:function"`` (default
      ``default_render_observation``).
    - ``parse_action``: response text (end-of-turn token removed) -> an Action instance or a dict of
      its fields; raise ValueError to reject it (the message is shown to the model). Default: the
      text is the Action's one string field.
    - ``tools``: None (default: an MCP environment is a tool environment), True or False.
    - ``format`` (tool mode): the tool-call format, default ``hermes``. ``context`` /
      ``context_kwargs``: the context policy (default ``append``: exact token ids).
    - ``system_prompt``: an opening system message; ``prompt_key``: a task field (a string or chat
      messages) shown before the first observation, if the task has it.
    - ``max_turns``: responses before the episode is truncated (default 8).
    - ``success_threshold``: ``info["success"]`` is "ended with done and the return >= this"
      (default 1.0; None: no success reported).
    - ``timeout_s``: the longest any reset, step or tool call may take (default 60).

    Task fields other than ``id`` and ``prompt_key`` are passed to ``reset`` as keyword arguments
    (as TRL passes dataset columns), less those ``reset`` does not take, as OpenEnv's server does;
    ``id`` becomes ``episode_id``.
    """

    def __init__(
        self,
        tokenizer: Any,
        *,
        environment: str | type | None = None,
        environment_kwargs: Mapping[str, Any] | None = None,
        server: Mapping[str, Any] | None = None,
        base_url: str | None = None,
        client: str | type | None = None,
        action: str | type | None = None,
        render_observation: str | Callable[[Any], str] | None = None,
        parse_action: str | Callable[[str], Any] | None = None,
        tools: bool | None = None,
        format: str = "hermes",
        context: str = "append",
        context_kwargs: Mapping[str, Any] | None = None,
        system_prompt: str | None = None,
        prompt_key: str = "prompt",
        max_turns: int = 8,
        success_threshold: float | None = 1.0,
        timeout_s: float = 60.0,
    ) -> None:
        core = openenv_core()
        require_chat_template(tokenizer)
        given = [
            name
            for name, value in (("environment", environment), ("server", server), ("base_url", base_url))
            if value
        ]
        if len(given) != 1:
            raise ValueError(
                "OpenEnvEnv needs exactly one of environment ('module:Class', run in-process), server "
                f"({{app: 'module:app'}}, served by uvicorn) or base_url (a running server); got {given or 'none'}"
            )
        if max_turns < 1:
            raise ValueError(f"OpenEnvEnv: max_turns must be >= 1, got {max_turns}")
        if not timeout_s > 0:
            raise ValueError(f"OpenEnvEnv: timeout_s must be > 0 seconds, got {timeout_s}")
        self.tokenizer = tokenizer
        self.environment = resolve(environment, "environment") if environment else None
        if self.environment is not None and not (
            isinstance(self.environment, type) and issubclass(self.environment, core.Environment)
        ):
            raise TypeError(f"OpenEnvEnv environment: {environment!r} is not an OpenEnv Environment subclass")
        self.environment_kwargs = dict(environment_kwargs or {})
        if environment_kwargs and not environment:
            raise ValueError("OpenEnvEnv: environment_kwargs apply to an in-process environment only")
        self.server = dict(server) if server else None
        if self.server is not None:
            unknown = sorted(set(self.server) - set(SERVER_KEYS))
            if unknown or "app" not in self.server:
                raise ValueError(
                    f"OpenEnvEnv server: keys are {list(SERVER_KEYS)} ('app' required), got {sorted(self.server)}"
                )
        self.base_url = base_url.rstrip("/") if base_url else None
        self.client_class = resolve(client, "client") if client else None
        if self.client_class is not None and not (
            isinstance(self.client_class, type) and issubclass(self.client_class, core.EnvClient)
        ):
            raise TypeError(f"OpenEnvEnv client: {client!r} is not an OpenEnv EnvClient subclass")
        if self.client_class is not None and self.environment is not None:
            raise ValueError("OpenEnvEnv: client applies to a served environment (server or base_url) only")
        self.action_class = resolve(action, "action") if action else self._declared_action()
        if self.action_class is not None and not (
            isinstance(self.action_class, type) and issubclass(self.action_class, core.Action)
        ):
            raise TypeError(f"OpenEnvEnv action: {action!r} is not an OpenEnv Action subclass")
        self.render_observation = (
            resolve(render_observation, "render_observation") or default_render_observation
        )
        self.parse_action = resolve(parse_action, "parse_action")
        for name, hook in (
            ("render_observation", self.render_observation),
            ("parse_action", self.parse_action),
        ):
            if hook is not None and not callable(hook):
                raise TypeError(f"OpenEnvEnv {name} must be {HOOK}, got {hook!r}")
        self.text_field: str | None = None
        self.rejection_hint = ""
        if self.parse_action is None and self.action_class is not None and tools is not True:
            # Checked here so a config error shows before any rollout (a tool environment needs none).
            text_field(self.action_class.model_json_schema(), self.action_class.__name__)
        self.tools, self.format = tools, format
        self.context = resolve_context_policy(context, context_kwargs, "OpenEnvEnv")
        self.context_name, self.context_kwargs = context, dict(context_kwargs or {})
        self.system_prompt, self.prompt_key = system_prompt, prompt_key
        self.max_turns, self.success_threshold, self.timeout_s = max_turns, success_threshold, timeout_s
        self.session: InProcessSession | RemoteSession | None = None
        self.tool_env: ToolEnv | None = None

    def _declared_action(self) -> type | None:
        core = openenv_core()
        if self.environment is not None:
            return declared_action_class(self.environment, core.Environment)
        if self.client_class is not None:
            return declared_action_class(self.client_class, core.EnvClient)
        return None

    # -- the episode ------------------------------------------------------------------------------

    async def _open_session(self) -> tuple[InProcessSession | RemoteSession, bool]:
        """The episode's session, and whether the environment is a tool environment."""
        if self.environment is not None:
            session = InProcessSession(self.environment, self.environment_kwargs, self.timeout_s)
            return session, self.tools
        server = None
        if self.server is not None:
            options = {k: v for k, v in self.server.items() if k != "app"}
            server = await run_in_daemon_thread(
                "openenv-setup", LocalServer.shared, self.server["app"], **options
            )
        session = RemoteSession(
            server.base_url if server else self.base_url, self.client_class, self.timeout_s, server
        )
        tools = self.tools
        if tools is None:
            tools = await session.query(serves_tools, "opening a session")
        if session.client_class is None:
            core = openenv_core()
            session.client_class = core.MCPToolClient if tools else core.GenericEnvClient
        return session, tools

    async def reset(self, task: Task) -> Observation:
        await self.close()
        self.task, self.turn, self.episode_return, self.done = task, 0, 0.0, False
        self.pending_reward, self.tool_env = 0.0, None
        kwargs = {k: v for k, v in task.items() if k not in ("id", self.prompt_key)}
        if "id" in task:
            kwargs["episode_id"] = str(task["id"])
        self.session, tools = await self._open_session()
        first = await self.session.reset(kwargs)
        if tools is None:  # in-process: OpenEnv's server's test, on the instance
            tools = self.session.is_tool_env
        opening = self._opening_messages(task, first.observation)
        if tools:
            return await self._reset_tools(opening)
        await self._find_text_field()
        prompt = await self.context.build(self.tokenizer, ContextRequest(tuple(opening), policy=self.policy))
        self.messages, self.prompt_ids = prompt.messages, prompt.token_ids
        return Observation(token_ids=prompt.token_ids)

    async def _find_text_field(self) -> None:
        """Chat mode without ``parse_action``: the Action field the response text fills."""
        if self.text_field is not None or self.parse_action is not None:
            return
        if self.action_class is not None:
            schema = self.action_class.model_json_schema()
        elif self.environment is not None:
            raise OpenEnvError(
                f"{self.session.where}: {self.environment.__name__} declares no Action class (neither "
                "Environment[MyAction, ...] nor step(self, action: MyAction)); give action: 'module:Class'"
            )
        else:
            schema = await self.session.query(action_schema, "reading its action schema")
            # The server says only "Invalid message" for an action it rejects: show the model the fields.
            fields = {
                name: {k: v for k, v in spec.items() if k not in ("title", "description")}
                for name, spec in schema.get("properties", {}).items()
                if name != "metadata"
            }
            self.rejection_hint = f"; the action's fields: {json.dumps(fields)[:300]}"
        try:
            self.text_field = text_field(schema, schema.get("title", "Action"))
        except ValueError as error:
            raise OpenEnvError(f"{self.session.where}: {error}") from None

    def _opening_messages(self, task: Task, observation: Any) -> list[Message]:
        messages: list[Message] = (
            [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        )
        if self.prompt_key in task:
            messages += task_messages(task, self.prompt_key)
        text = self.render_observation(observation)
        if text or not messages:
            messages.append({"role": "user", "content": text})
        return messages

    def _content(self, action: Action) -> str:
        eos = self.tokenizer.eos_token
        return action.text[: -len(eos)] if eos and action.text.endswith(eos) else action.text

    def _to_action(self, text: str) -> Any:
        """The response as an OpenEnv action; ValueError (a pydantic ValidationError is one) if invalid."""
        value = self.parse_action(text) if self.parse_action is not None else {self.text_field: text}
        if self.action_class is not None and not isinstance(value, self.action_class):
            return self.action_class.model_validate(value)
        return value

    def _ending(self, info: dict[str, Any]) -> dict[str, Any]:
        if self.success_threshold is not None:
            info["success"] = self.done and self.episode_return >= self.success_threshold
        return info

    async def step(self, action: Action) -> StepResult:
        if self.session is None:
            raise RuntimeError("OpenEnvEnv.step called before reset(task)")
        if self.tool_env is not None:
            return await self._step_tools(action)
        self.turn += 1
        content = self._content(action)
        info: dict[str, Any] = {"turn": self.turn}
        try:
            reply: Reply | None = await self.session.step(self._to_action(content))
            invalid = None
        except ActionRejected as error:
            reply, invalid = None, f"Invalid action: {error}{self.rejection_hint}"
        except ValueError as error:  # the hook or the Action's validation refused it
            reply, invalid = None, f"Invalid action: {validation_message(error)}"
        metrics = {"invalid_actions": float(invalid is not None)}
        reward = reply.reward if reply else 0.0
        self.episode_return += reward
        if invalid is not None:
            info["invalid_action"] = invalid
        if reply is not None and reply.done:
            self.done = True
            info = self._ending(info)
            return StepResult(None, reward=reward, terminated=True, info=info, metrics=metrics)
        if self.turn >= self.max_turns:
            info = self._ending({**info, "truncated": f"max_turns={self.max_turns} reached"})
            return StepResult(None, reward=reward, truncated=True, info=info, metrics=metrics)
        shown = invalid if invalid is not None else self.render_observation(reply.observation)
        assistant = {"role": "assistant", "content": content}
        previous = PreviousTurn(self.prompt_ids, action.token_ids, num_messages=len(self.messages))
        request = ContextRequest(
            (*self.messages, assistant, {"role": "user", "content": shown}),
            previous=previous,
            policy=self.policy,
        )
        prompt = await self.context.build(self.tokenizer, request)
        self.messages, self.prompt_ids = prompt.messages, prompt.token_ids
        info["context"] = prompt.info
        return StepResult(
            Observation(token_ids=prompt.token_ids),
            reward=reward,
            info=info,
            policy_steps=prompt.steps,
            metrics=metrics,
        )

    # -- tool mode --------------------------------------------------------------------------------

    async def _reset_tools(self, opening: list[Message]) -> Observation:
        core = openenv_core()
        reply = await self._session_step(core.ListToolsAction())
        listed = getattr(reply.observation, "tools", None)
        if listed is None and isinstance(reply.observation, Mapping):
            listed = reply.observation.get("tools")
        if not listed:
            raise OpenEnvError(
                f"{self.session.where}: ListToolsAction returned no tools ({reply.observation!r})"
            )
        tools = []
        for spec in listed:
            spec = spec.model_dump() if hasattr(spec, "model_dump") else dict(spec)
            try:
                tools.append(
                    OpenEnvTool(spec["name"], spec.get("description", ""), spec.get("input_schema", {}), self)
                )
            except ValueError as error:
                raise OpenEnvError(f"{self.session.where}: tool {spec.get('name')!r}: {error}") from None
        self.tool_env = ToolEnv(
            self.tokenizer,
            tools,
            format=self.format,
            context=self.context_name,
            context_kwargs=self.context_kwargs or None,
            outcome_reward=lambda answer, task: 0.0,  # OpenEnv rewards come with its steps
            step_reward=self._take_reward,
            max_turns=self.max_turns,
            prompt_key="messages",
        )
        if self.policy is not None:
            self.tool_env.lend_policy(self.policy)
        return await self.tool_env.reset({"messages": opening})

    def _take_reward(self, parsed: Any, results: Any, task: Task) -> float:
        reward, self.pending_reward = self.pending_reward, 0.0
        return reward

    async def _session_step(self, action: Any) -> Reply:
        try:
            return await self.session.step(action)
        except ActionRejected as error:
            raise OpenEnvError(f"{self.session.where}: {error}") from None

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> str:
        """One tool call of the model: a ``CallToolAction`` step; its reward and done are kept."""
        if self.done:
            raise ToolArgumentError("the episode is over (done); no more tool calls")
        reply = await self._session_step(openenv_core().CallToolAction(tool_name=name, arguments=arguments))
        self.pending_reward += reply.reward
        self.episode_return += reply.reward
        self.done = self.done or reply.done
        observation = reply.observation
        error = getattr(observation, "error", None)
        if isinstance(observation, Mapping):
            error = observation.get("error")
        if error:
            message = error.get("message") if isinstance(error, Mapping) else getattr(error, "message", error)
            raise ToolArgumentError(str(message))
        result = (
            observation.get("result")
            if isinstance(observation, Mapping)
            else getattr(observation, "result", None)
        )
        if tool_failed(result):
            raise ToolArgumentError(tool_text(result))
        return tool_text(result)

    async def _step_tools(self, action: Action) -> StepResult:
        result = await self.tool_env.step(action)
        failure = getattr(self.session, "failure", None)
        if failure is not None:  # the server died or hung during a call: the episode cannot go on
            raise failure
        counts = result.info.get("tool_counts", {})
        metrics = {"invalid_actions": float(bool(counts.get("parse_errors") or counts.get("tool_errors")))}
        info = dict(result.info)
        info.pop("success", None)
        if self.done:
            return replace(
                result,
                observation=None,
                terminated=True,
                truncated=False,
                outcome_reward=None,
                info=self._ending(info),
                metrics=metrics,
            )
        if result.terminated or result.truncated:  # the model stopped calling tools, or max_turns
            return replace(result, outcome_reward=None, info=self._ending(info), metrics=metrics)
        return replace(result, info=info, metrics=metrics)

    async def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            await session.close()
