"""OpenEnv environments as agent-r1 ``AgentEnv`` s (docs/ecosystem.md, "OpenEnv").

OpenEnv (``openenv-core``) environments subclass ``openenv.core.Environment``: ``reset(seed,
episode_id, **kwargs)`` and ``step(action)`` both return a typed pydantic ``Observation`` that
carries ``reward`` and ``done``; actions are typed pydantic ``Action`` s. OpenEnv serves an
environment with ``create_app(EnvClass, ActionClass, ObservationClass)`` (FastAPI, run by uvicorn)
and reaches it with an ``EnvClient`` over the server's WebSocket ``/ws``. MCP tool environments
(``MCPEnvironment``) take ``ListToolsAction`` / ``CallToolAction``.

**Where the environment runs** (exactly one of):

- ``environment: "module:Class"``: in this process, one instance per trajectory. Its methods are
  called as OpenEnv's server calls them: ``reset_async`` / ``step_async`` when the class overrides
  them, else the sync ``reset`` / ``step`` on one worker thread per episode (the server's
  per-session executor).
- ``server: {app: "module:app"}``: served by ``python -m uvicorn module:app --host 127.0.0.1
  --port <free>`` (how OpenEnv's own ``UVProvider`` starts one, without uv), started by the
  adapter on first use, once per process and app, and reached through OpenEnv's client.
- ``base_url: "http://host:port"``: a server already running, reached the same way.

**Sessions.** One server, one WebSocket session per trajectory. OpenEnv's server gives each
``/ws`` connection its own ``Environment`` instance (up to the app's ``max_concurrent_envs``,
default 1); its HTTP ``/reset`` and ``/step`` build a fresh environment per request, so a
multi-step episode needs the WebSocket. A session refused because the server is full waits and
retries until ``timeout_s`` (OpenEnv's template serves one session at a time; raise
``max_concurrent_envs`` in the app, as TRL's OpenEnv guide says, for concurrent rollouts).

**Mapping.** Chat mode: the observation (minus ``reward``/``done``/``metadata``) becomes a user
message (``render_observation``); the response text becomes an Action (``parse_action``); an
action that does not validate is an observation saying what is wrong (the episode goes on,
``env/invalid_actions``). Tool mode (an MCP environment): its tools, listed per session, become
agent-r1 ``Tool`` s and a ``ToolEnv`` parses the model's calls in ``format``; each call is a
``CallToolAction``. Both: OpenEnv's per-step ``reward`` is the step's immediate reward (the
rewards of a response's calls summed), ``done`` ends the episode (``terminated``), ``max_turns``
responses truncate it; no outcome reward. ``info["success"]``: the episode ended with ``done``
and its return reached ``success_threshold``.

**Failures.** A server that dies, closes the session or does not answer within ``timeout_s``
ends the trajectory with an error (``OpenEnvError``) naming the server and, for one the adapter
started, its exit code and last log lines; the next trajectory restarts a dead server. A step
that hangs holds its server session until it returns (OpenEnv cannot cancel it).

**Modules.** ``env`` (the adapter, ``OpenEnvEnv``), ``sessions`` (an episode in-process or over a
server's WebSocket), ``server`` (the uvicorn server the adapter starts; HTTP questions to any
server), ``tools`` (an MCP environment's tools), ``introspect`` (the classes and entry points a
config names), ``text`` (observations as text), ``errors``.
"""

from agent_r1.envs.ecosystem.openenv.env import OpenEnvEnv
from agent_r1.envs.ecosystem.openenv.errors import OpenEnvError
from agent_r1.envs.ecosystem.openenv.introspect import text_field
from agent_r1.envs.ecosystem.openenv.server import LocalServer
from agent_r1.envs.ecosystem.openenv.text import default_render_observation

__all__ = ["LocalServer", "OpenEnvEnv", "OpenEnvError", "default_render_observation", "text_field"]
