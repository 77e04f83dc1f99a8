"""The verifiers side of agent-r1's verifiers adapter. It runs in the verifiers venv
(``.venv-verifiers``, made by ``scripts/install_verifiers.sh``) and never imports agent_r1: verifiers
pins ``openai<3`` and ``mcp==2.0.0``, which agent-r1's own venv does not have.

``agent_r1.envs.ecosystem.verifiers`` starts it as ``python verifiers_worker.py CONFIG_JSON`` where the
config is ``{"env": <a verifiers EnvConfig as a dict>, "recycle_after": int, "max_concurrent": int | None}``
(episodes at once; more wait their turn, as in verifiers' env server). It builds the
verifiers ``Env`` (taskset + harness + runtime) once, listens on a localhost TCP port and prints one
JSON line on stdout: ``{"address": [host, port], "taskset": ..., "harness": ..., "seat": ...}``, or
``{"error": ..., "kind": ...}`` (``kind`` ``"unknown_taskset"`` comes with ``"available"``) and exits.

Each connection carries one JSON request line and gets one JSON reply line:

- ``{"op": "run", "task": <TaskData as a dict>, "base_url", "api_key", "model"}`` runs one episode of
  that row, exactly as verifiers' own env server does (``Env.slots`` + ``Env.run_slot`` inside
  ``Env.serving``), with the model client pointed at ``base_url`` (an agent-r1 gateway session);
  the reply is ``{"reward", "rewards", "metrics", "turns", "stop"}`` or ``{"error"}``. Closing the
  connection before the reply cancels the episode (agent-r1 cut it: ``rollout.max_steps``, a time
  limit).
- ``{"op": "tasks", "taskset": {<TasksetConfig fields to override>}, "skip": int, "limit": int}``
  lists the taskset's rows (``TaskData`` dumps without default values) -> ``{"tasks": [...]}``.

The worker exits when its stdin closes (the agent-r1 process that started it ended).

Why episodes run in "generations": verifiers' interception server keeps one HTTP client per distinct
model endpoint for as long as the env serves (~650 KiB each, an SSL context), and every agent-r1
rollout is a new endpoint (its own gateway session). So after ``recycle_after`` episodes new
episodes go to a freshly loaded ``Env`` and the old one stops serving once its episodes end.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import pkgutil
import sys
import threading
import traceback
import uuid
from typing import Any

# Not this file's folder on sys.path: agent-r1's ``verifiers.py`` there would shadow the package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def _emit(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()


def available_tasksets() -> list[str]:
    """Taskset ids this worker can load: verifiers' built-in ones, the packages on PYTHONPATH that
    export a ``Taskset``, and installed distributions that depend on verifiers (hub environments)."""
    from verifiers.v1 import tasksets
    from verifiers.v1.taskset import Taskset

    names = {m.name for m in pkgutil.iter_modules(tasksets.__path__)}
    for folder in filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep)):
        for module in pkgutil.iter_modules([folder]):
            with contextlib.suppress(Exception):
                imported = importlib.import_module(module.name)
                exported = [getattr(imported, n, None) for n in getattr(imported, "__all__", ())]
                if any(isinstance(c, type) and issubclass(c, Taskset) for c in exported):
                    names.add(module.name)
    for module, distributions in importlib.metadata.packages_distributions().items():
        for name in distributions:
            requires = importlib.metadata.requires(name) or []
            if name != "verifiers" and any(r.split(";")[0].strip().startswith("verifiers") for r in requires):
                names.add(module)
    return sorted(names)


def _taskset_exists(taskset_id: str) -> bool:
    module = taskset_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()
    return any(
        importlib.util.find_spec(name) is not None for name in (f"verifiers.v1.tasksets.{module}", module)
    )


class Generation:
    """One loaded ``Env`` serving episodes until it is retired and its last episode ends."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.active = 0
        self.served = 0
        self.ready = asyncio.Event()
        self.retired = asyncio.Event()
        self.idle = asyncio.Event()
        self.idle.set()
        self.task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        async with self.env.serving():
            self.ready.set()
            await self.retired.wait()
            await self.idle.wait()

    async def started(self) -> None:
        ready = asyncio.ensure_future(self.ready.wait())
        await asyncio.wait({ready, self.task}, return_when=asyncio.FIRST_COMPLETED)
        if not ready.done():
            ready.cancel()
            self.task.result()  # raises why serving failed to start
            raise RuntimeError("the verifiers env stopped serving")


class Worker:
    def __init__(
        self, config: dict[str, Any], env: Any, recycle_after: int, max_concurrent: int | None
    ) -> None:
        self.config = config
        self.recycle_after = recycle_after
        self.gate = asyncio.Semaphore(max_concurrent) if max_concurrent else contextlib.nullcontext()
        self.generations: set[Generation] = set()
        self.current = self._add(Generation(env))

    def _add(self, generation: Generation) -> Generation:
        self.generations.add(generation)  # until it stops serving: then it is garbage
        generation.task.add_done_callback(lambda _: self.generations.discard(generation))
        return generation

    def _generation(self) -> Generation:
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config

        if self.current.served >= self.recycle_after:
            self.current.retired.set()
            self.current = self._add(Generation(load_environment(resolve_env_config(self.config))))
        return self.current

    def _task(self, env: Any, data: dict[str, Any]) -> Any:
        # As verifiers' EnvServer builds a dispatched task: the row validated into the taskset's
        # TaskData type, wrapped in its Task with the config's task subtree.
        task_cls = type(env.taskset).task_type()
        return task_cls(task_cls.data_type().model_validate(data), env.config.taskset.task)

    async def run(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self.gate:
            return await self._run(request)

    async def _run(self, request: dict[str, Any]) -> dict[str, Any]:
        import verifiers.v1 as vf

        generation = self._generation()
        generation.active += 1
        generation.served += 1
        generation.idle.clear()
        # verifiers reads a client's key from the environment; a name with API_KEY in it is one the
        # subprocess runtime keeps from the harness programs it starts.
        key_var = f"AGENT_R1_GATEWAY_API_KEY_{uuid.uuid4().hex}"
        os.environ[key_var] = request["api_key"]
        try:
            await generation.started()
            env = generation.env
            client = vf.EvalClientConfig(base_url=request["base_url"], api_key_var=key_var)
            ctx = vf.ModelContext(model=request.get("model", "agent-r1"), client=client)
            (slot,) = env.slots(self._task(env, request["task"]))
            episode = await env.run_slot(slot, ctx)
        finally:
            os.environ.pop(key_var, None)
            generation.active -= 1
            if generation.active == 0:
                generation.idle.set()
        return summarise(episode)

    def tasks(self, request: dict[str, Any]) -> dict[str, Any]:
        from verifiers.v1.utils.loaders import load_taskset, taskset_config_type

        base = self.current.env.config.taskset
        config = taskset_config_type(base.id).model_validate(
            {**base.model_dump(exclude_unset=True), **request.get("taskset", {}), "id": base.id}
        )
        view = load_taskset(config).skip(int(request.get("skip", 0)))
        if request.get("limit") is not None:
            view = view.take(int(request["limit"]))
        return {"tasks": [task.data.model_dump(mode="json", exclude_defaults=True) for task in view]}

    async def close(self) -> None:
        generations = list(self.generations)
        for generation in generations:
            generation.task.cancel()
        await asyncio.gather(*(g.task for g in generations), return_exceptions=True)


def _error_text(error: Any) -> str:
    text = f"{error.type}: {error.message}"
    if error.traceback:
        text += "\n" + error.traceback.strip()[-3000:]
    return text


def summarise(episode: Any) -> dict[str, Any]:
    """What agent-r1 needs from a finished episode: the reward its taskset's reward functions gave
    (their weighted sum, as verifiers' ``Trace.reward``), each named reward and metric, and why it
    stopped; or the episode's errors when it failed."""
    errors = [_error_text(e) for e in episode.errors]
    for trace in episode.traces:
        if not trace.ok:
            last = trace.last_error
            errors.append(_error_text(last) if last is not None else "the verifiers trace is not ok")
    if errors or not episode.traces:
        return {"error": "\n".join(errors) or "the verifiers episode produced no trace"}
    (trace,) = episode.traces
    return {
        "reward": trace.reward,
        "rewards": {name: r.value for name, r in trace.rewards.items() if r is not None},
        "metrics": {name: float(v) for name, v in trace.metrics.items() if isinstance(v, int | float)},
        "turns": trace.num_turns,
        "stop": trace.stop_condition,
    }


async def handle(worker: Worker, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        request = json.loads(await reader.readline())
        if request.get("op") == "tasks":
            reply = worker.tasks(request)
        elif request.get("op") == "run":
            work = asyncio.ensure_future(worker.run(request))
            hangup = asyncio.ensure_future(reader.read(1))  # b"" once the caller closes its end
            await asyncio.wait({work, hangup}, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():  # the caller gave up on this episode: stop it
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                return
            hangup.cancel()
            reply = work.result()
        else:
            reply = {"error": f"unknown op {request.get('op')!r}; the worker serves 'run' and 'tasks'"}
    except Exception as error:  # a failed request is an answer, not the worker's end
        reply = {"error": f"{type(error).__name__}: {error}\n{traceback.format_exc()[-3000:]}"}
    with contextlib.suppress(ConnectionError):
        writer.write((json.dumps(reply) + "\n").encode())
        await writer.drain()
    writer.close()


def load(config: dict[str, Any]) -> tuple[Any, dict[str, Any]] | dict[str, Any]:
    """The verifiers env for ``config``, or the error line saying why it cannot be built."""
    try:
        from verifiers.v1.configs.agent import agent_config_fields
        from verifiers.v1.utils.loaders import load_environment, resolve_env_config
    except ImportError as error:
        return {"kind": "missing_verifiers", "error": f"cannot import verifiers.v1 ({error})"}
    taskset_id = config.get("taskset", {}).get("id", "")
    if not _taskset_exists(taskset_id):
        return {
            "kind": "unknown_taskset",
            "error": f"unknown verifiers taskset {taskset_id!r}",
            "available": available_tasksets(),
        }
    try:
        env = load_environment(resolve_env_config(config))
    except Exception as error:
        return {"kind": "invalid_config", "error": f"{type(error).__name__}: {error}"}
    seats = list(agent_config_fields(env.config))
    if len(seats) != 1:
        return {
            "kind": "unsupported",
            "error": f"{type(env).__name__} has {len(seats)} agent seats {seats}; the agent-r1 adapter "
            "trains single-agent verifiers envs (one seat, one trace per episode)",
        }
    harness = env.config.agent_harnesses()[seats[0]].id
    return env, {"taskset": taskset_id, "harness": harness, "seat": seats[0], "env": type(env).__name__}


async def main(config: dict[str, Any]) -> None:
    loaded = load(config["env"])
    if isinstance(loaded, dict):
        _emit(loaded)
        return
    env, described = loaded
    worker = Worker(config["env"], env, int(config.get("recycle_after", 64)), config.get("max_concurrent"))
    server = await asyncio.start_server(lambda r, w: handle(worker, r, w), "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    _emit({"address": [host, port], **described})
    stdin_closed = asyncio.Event()
    loop = asyncio.get_running_loop()

    def watch_stdin() -> None:
        sys.stdin.read()
        loop.call_soon_threadsafe(stdin_closed.set)

    threading.Thread(target=watch_stdin, daemon=True).start()
    async with server:
        await stdin_closed.wait()
    await worker.close()


if __name__ == "__main__":
    asyncio.run(main(json.loads(sys.argv[1])))
