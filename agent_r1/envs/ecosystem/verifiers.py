"""verifiers (Prime Intellect) tasksets as agent-r1 environments: the taskset's harness runs
unchanged, its model calls go through agent-r1's gateway, its reward functions give the reward.

A verifiers v1 environment is a taskset (data rows and, per row, a ``Task`` with ``@vf.reward``
functions), a harness (the program that plays a row: ``null`` is a plain chat loop, ``bash`` a tool
loop with a bash tool) and a runtime (where the harness runs: ``subprocess`` on this machine, docker,
remote sandboxes). verifiers catches the harness's model calls in its interception server and sends
them to a model endpoint. This adapter makes that endpoint an agent-r1 gateway session, so it is an
agent program (``agent_r1.envs.agent_program``): each model call of the harness is one Step whose
prompt ids are exact token-level extensions of the previous call when the conversation only grew,
and the episode's outcome reward is what the taskset's reward functions gave (verifiers'
``Trace.reward``, the weighted sum).

verifiers runs in a venv of its own (``.venv-verifiers``, ``bash scripts/install_verifiers.sh``):
it pins ``openai<3`` and ``mcp==2.0.0``, which agent-r1's venv does not have. The env starts one
worker process there per configuration (``verifiers_worker.py``, shared by every env of this process
with the same configuration), which loads the verifiers ``Env`` once and runs each episode the way
verifiers' own env server does; agent-r1 talks to it over a localhost socket.

Rows: the training data are the taskset's rows (its ``TaskData`` as dicts, with any extra agent-r1
fields ignored); ``load_tasks`` lists them, ``python -m agent_r1.envs.ecosystem.verifiers export``
writes them to a JSONL file for ``data.train`` / ``data.val``.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import json
import logging
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from agent_r1.envs.agent_program import AgentProgramEnv, AgentResult
from agent_r1.envs.base import AgentEnv
from agent_r1.envs.ecosystem import MissingPackageError
from agent_r1.types import Action, Observation, StepResult, Task

__all__ = [
    "INSTALL_SCRIPT",
    "VENV_VARIABLE",
    "VerifiersEnv",
    "VerifiersError",
    "find_venv",
    "load_tasks",
]

logger = logging.getLogger(__name__)

INSTALL_SCRIPT = "scripts/install_verifiers.sh"
VENV_VARIABLE = "AGENT_R1_VERIFIERS_VENV"
WORKER_FILE = Path(__file__).with_name("verifiers_worker.py")
REPO_ROOT = Path(__file__).resolve().parents[3]


class VerifiersError(RuntimeError):
    """The verifiers worker could not start, or an episode failed inside verifiers."""


class UnknownTasksetError(VerifiersError, ValueError):
    """No verifiers taskset has this id; the message lists the ones the worker can load."""


def find_venv(venv: str | os.PathLike | None = None) -> Path:
    """The verifiers venv: ``venv`` when given, else ``$AGENT_R1_VERIFIERS_VENV``, else
    ``.venv-verifiers`` in the working directory or in agent-r1's checkout. Missing, it is a
    ``MissingPackageError`` naming the install script."""
    if venv is not None:
        candidates = [Path(venv)]
    elif os.environ.get(VENV_VARIABLE):
        candidates = [Path(os.environ[VENV_VARIABLE])]
    else:
        candidates = list(dict.fromkeys([Path.cwd() / ".venv-verifiers", REPO_ROOT / ".venv-verifiers"]))
    for candidate in candidates:
        if (candidate / "bin" / "python").exists():
            return candidate.absolute()
    raise MissingPackageError(
        "the verifiers env runs verifiers in a venv of its own (verifiers pins openai<3 and mcp==2.0.0) "
        f"and found none at {', '.join(str(c) for c in candidates)}: make it with `bash {INSTALL_SCRIPT}` "
        f"in agent-r1's checkout, or point env.kwargs.venv / ${VENV_VARIABLE} at one"
    )


# ---------------------------------------------------------------------------------------------------
# The worker process (one per configuration, shared by the envs of this process)
# ---------------------------------------------------------------------------------------------------


class _Worker:
    """A running ``verifiers_worker.py``: its process, its address and its log."""

    def __init__(self, python: Path, config: dict, python_path: list[str], startup_timeout_s: float) -> None:
        self.log_path = Path(tempfile.mkdtemp(prefix="agent-r1-verifiers-")) / "worker.log"
        env = {
            **os.environ,
            "PATH": f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}",  # the venv's uv, for harnesses
            "PYTHONPATH": os.pathsep.join(python_path),
            "VIRTUAL_ENV": str(python.parent.parent),
        }
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [str(python), str(WORKER_FILE), json.dumps(config)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env=env,
            )
        line = self._first_line(startup_timeout_s)
        if "error" in line:
            self.stop()
            error = self._startup_error(line, config)
            self.discard_log(always=True)  # (the error is the worker's own answer; the log is not named)
            raise error
        self.address = tuple(line["address"])

    def _first_line(self, timeout_s: float) -> dict:
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                self.stop()
                error = VerifiersError(
                    f"the verifiers worker did not start within {timeout_s:g}s; its log: {self.log_tail()}"
                )
                self.discard_log()
                raise error
        raw = self.process.stdout.readline()
        if not raw:
            self.process.wait()
            error = VerifiersError(
                f"the verifiers worker exited ({self.process.returncode}) while starting; its log: "
                f"{self.log_tail()}"
            )
            self.discard_log()
            raise error
        return json.loads(raw)

    @staticmethod
    def _startup_error(line: dict, config: dict) -> Exception:
        kind, error = line.get("kind"), line["error"]
        if kind == "missing_verifiers":
            return MissingPackageError(
                f"the verifiers venv has no usable verifiers ({error}): run `bash {INSTALL_SCRIPT}`"
            )
        if kind == "unknown_taskset":
            return UnknownTasksetError(
                f"{error}; available: {line['available']} (a taskset id is an importable package exporting "
                "a verifiers Taskset: add its folder to env.kwargs.python_path, or install it into the "
                "verifiers venv)"
            )
        if kind == "unsupported":
            return VerifiersError(error)
        return ValueError(f"verifiers rejected the env config {json.dumps(config)}: {error}")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return f"(no log at {self.log_path})"
        return f"{self.log_path}:\n{text[-chars:]}" if text else f"{self.log_path} (empty)"

    def discard_log(self, always: bool = False) -> None:
        """Remove the log's folder unless it holds something to read: it goes once the worker exited
        cleanly (0) or wrote nothing (or ``always``); a log of a failure stays where its error or
        warning names it."""
        written = self.log_path.exists() and self.log_path.stat().st_size > 0
        if always or self.process.returncode == 0 or not written:
            shutil.rmtree(self.log_path.parent, ignore_errors=True)

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close its stdin (it then stops serving and cleans up), then kill it if it lingers."""
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def died(self) -> VerifiersError:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(1.0)  # a killed worker's socket can close just before it is reaped
        state = "is still running" if self.alive() else f"exited with {self.process.returncode}"
        return VerifiersError(
            f"the verifiers worker (pid {self.process.pid}) closed the connection without an answer and "
            f"{state}; its log: {self.log_tail()}"
        )

    async def request(self, payload: dict) -> dict:
        """Send one request and wait for its answer; cancelling this closes the connection, which
        makes the worker cancel the episode."""
        try:
            reader, writer = await asyncio.open_connection(*self.address, limit=2**26)
        except OSError as error:
            raise self.died() from error
        try:
            writer.write((json.dumps(payload) + "\n").encode())
            await writer.drain()
            line = await reader.readline()
        except OSError as error:
            raise self.died() from error
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if not line:
            raise self.died()
        return json.loads(line)

    def request_sync(self, payload: dict, timeout_s: float | None = None) -> dict:
        with socket.create_connection(self.address, timeout=timeout_s) as connection:
            connection.sendall((json.dumps(payload) + "\n").encode())
            with connection.makefile("rb") as stream:
                line = stream.readline()
        if not line:
            raise self.died()
        return json.loads(line)


_workers: dict[str, _Worker] = {}
_workers_lock = threading.Lock()


def _worker_for(
    taskset: str,
    *,
    taskset_config: dict | None = None,
    harness: str | None = "null",
    harness_config: dict | None = None,
    runtime: str | dict = "subprocess",
    agent: dict | None = None,
    python_path: list[str] | tuple[str, ...] | str = (),
    venv: str | os.PathLike | None = None,
    recycle_after: int = 64,
    max_concurrent: int | None = 16,
    startup_timeout_s: float = 120.0,
) -> _Worker:
    """The running worker for this configuration (``VerifiersEnv``'s keyword arguments), started, or
    restarted after it died, if need be."""
    env_config = _env_config(taskset, taskset_config, harness, harness_config, runtime, agent)
    python = find_venv(venv) / "bin" / "python"
    config = {"env": env_config, "recycle_after": recycle_after, "max_concurrent": max_concurrent}
    paths = [os.path.abspath(p) for p in ([python_path] if isinstance(python_path, str) else python_path)]
    key = json.dumps([str(python), config, paths], sort_keys=True)
    with _workers_lock:
        worker = _workers.get(key)
        if worker is not None and not worker.alive():
            logger.warning(
                "the verifiers worker (pid %d) had exited (%s); starting a new one. Its log: %s",
                worker.process.pid,
                worker.process.returncode,
                worker.log_tail(),
            )
            worker.discard_log()  # (kept if it wrote anything: the warning names it)
            worker = None
        if worker is None:
            worker = _workers[key] = _Worker(python, config, paths, startup_timeout_s)
        return worker


@atexit.register
def _stop_workers() -> None:
    with _workers_lock:
        workers = list(_workers.values())
        _workers.clear()
    for worker in workers:
        worker.stop()
        worker.discard_log()


def _env_config(
    taskset: str,
    taskset_config: dict | None,
    harness: str | None,
    harness_config: dict | None,
    runtime: str | dict,
    agent: dict | None,
) -> dict:
    """The verifiers ``EnvConfig`` (as a dict) of the single-agent env over ``taskset``."""
    if not isinstance(taskset, str) or not taskset:
        raise ValueError(f"VerifiersEnv: taskset must be a verifiers taskset id (a str), got {taskset!r}")
    agent_config = dict(agent or {})
    for key in ("harness", "runtime"):
        if key in agent_config:
            raise ValueError(
                f"VerifiersEnv: set the {key} with env.kwargs.{key}, not inside env.kwargs.agent"
            )
    if harness is not None:
        agent_config["harness"] = {**(harness_config or {}), "id": harness}
    elif harness_config:
        raise ValueError("VerifiersEnv: harness_config needs a harness id (env.kwargs.harness)")
    agent_config["runtime"] = {"type": runtime} if isinstance(runtime, str) else dict(runtime)
    return {"taskset": {**(taskset_config or {}), "id": taskset}, "agent": agent_config}


# ---------------------------------------------------------------------------------------------------
# The env
# ---------------------------------------------------------------------------------------------------


class VerifiersEnv(AgentEnv):
    """One verifiers episode per trajectory: the taskset's harness plays the row, each of its model
    calls is one step, the taskset's reward functions give the outcome reward.

    Config (``env.kwargs`` of ``env.name: verifiers``)::

        taskset: parity               # the verifiers taskset id (an importable package exporting a Taskset)
        taskset_config: {split: train}  # its TasksetConfig fields (verifiers' --env.taskset.*)
        harness: "null"               # the harness id, quoted in YAML: "null" (one chat loop, no tools),
                                      # "bash" (a bash/edit tool loop), ...; None: the taskset's default
        harness_config: {}            # the harness's config fields (--env.agent.harness.*)
        runtime: subprocess           # where the harness runs: a runtime type or its config dict
        agent: {}                     # other verifiers AgentConfig fields: max_turns, timeout, ...
        python_path: [examples/verifiers]  # the worker's PYTHONPATH (folders holding taskset packages)
        venv: null                    # the verifiers venv (default: see find_venv)
        timeout_s: 600                # one episode's time limit in agent-r1 (then the trajectory is an ERROR)
        format: hermes                # the tool-call format parsing responses into tool_calls
        success_threshold: 1.0        # info["success"] = reward >= this
        recycle_after: 64             # episodes per loaded verifiers Env in the worker (bounds its memory)
        max_concurrent: 16            # episodes the worker runs at once (each runs a harness process)
        startup_timeout_s: 120        # how long the worker may take to load the env

    Every step's ``info["gateway"]`` says whether its prompt extended an earlier call exactly
    (``agent_r1.envs.agent_program``); the last step's ``info["verifiers"]`` holds the named rewards,
    metrics, turns and stop condition, which are also its ``metrics`` (``reward_<name>``, each
    metric by its name, ``turns``), logged as ``env/<name>``. A failed verifiers episode (the harness
    exited non-zero, a verifiers timeout, a reward function raised) ends the trajectory with status
    ERROR and verifiers' error; so does a worker that dies, at once, or hangs, after ``timeout_s``.
    """

    reset_calls_policy = True  # reset runs the harness up to its first model call

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        taskset: str,
        *,
        taskset_config: dict | None = None,
        harness: str | None = "null",
        harness_config: dict | None = None,
        runtime: str | dict = "subprocess",
        agent: dict | None = None,
        python_path: list[str] | tuple[str, ...] = (),
        venv: str | os.PathLike | None = None,
        timeout_s: float | None = 600.0,
        format: str = "hermes",
        success_threshold: float = 1.0,
        recycle_after: int = 64,
        max_concurrent: int | None = 16,
        startup_timeout_s: float = 120.0,
    ) -> None:
        self.worker = _worker_for(
            taskset,
            taskset_config=taskset_config,
            harness=harness,
            harness_config=harness_config,
            runtime=runtime,
            agent=agent,
            python_path=python_path,
            venv=venv,
            recycle_after=recycle_after,
            max_concurrent=max_concurrent,
            startup_timeout_s=startup_timeout_s,
        )
        self.program = AgentProgramEnv(
            tokenizer, self.episode, timeout_s=timeout_s, format=format, success_threshold=success_threshold
        )

    async def episode(self, task: Task, client: Any) -> AgentResult:
        """The agent program: one verifiers episode of ``task`` against the gateway session behind
        ``client``."""
        reply = await self.worker.request(
            {
                "op": "run",
                "task": dict(task),
                "base_url": str(client.base_url),
                "api_key": client.api_key,
                "model": "agent-r1",
            }
        )
        if "error" in reply:
            raise VerifiersError(f"the verifiers episode failed: {reply['error']}")
        summary = {key: reply[key] for key in ("rewards", "metrics", "turns", "stop")}
        return AgentResult(reward=float(reply["reward"]), info={"verifiers": summary})

    async def reset(self, task: Task) -> Observation:
        return await self.program.reset(task)

    async def step(self, action: Action) -> StepResult:
        result = await self.program.step(action)
        summary = result.info.get("verifiers")
        if summary is None:
            return result
        metrics = {f"reward_{name}": value for name, value in summary["rewards"].items()}
        metrics.update(summary["metrics"], turns=summary["turns"])
        return replace(result, metrics={**result.metrics, **metrics})

    async def close(self) -> None:
        await self.program.close()


def load_tasks(
    taskset: str,
    *,
    overrides: dict | None = None,
    skip: int = 0,
    limit: int | None = None,
    timeout_s: float | None = 600.0,
    **env_kwargs: Any,
) -> list[dict]:
    """The taskset's rows (its ``TaskData`` as dicts without default values), ``skip`` then ``limit``:
    the tasks a ``VerifiersEnv`` runs. ``env_kwargs`` are ``VerifiersEnv``'s (``python_path``,
    ``taskset_config``, ``venv``...), so the listing uses the env's worker; ``overrides`` are
    TasksetConfig fields for this listing only (e.g. ``{"split": "test"}`` for held-out rows)."""
    worker = _worker_for(taskset, **env_kwargs)
    request = {"op": "tasks", "taskset": overrides or {}, "skip": skip, "limit": limit}
    reply = worker.request_sync(request, timeout_s)
    if "error" in reply:
        raise VerifiersError(f"listing the rows of taskset {taskset!r} failed: {reply['error']}")
    return reply["tasks"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m agent_r1.envs.ecosystem.verifiers",
        description="Write a verifiers taskset's rows to a JSONL file (data.train / data.val of env.name: verifiers).",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    export = commands.add_parser("export", help="write the rows of a taskset")
    export.add_argument("taskset", help="the verifiers taskset id")
    export.add_argument("out", help="the JSONL file to write")
    export.add_argument("--taskset-config", default="{}", help="TasksetConfig fields, as JSON (e.g. a split)")
    export.add_argument("--skip", type=int, default=0)
    export.add_argument("--limit", type=int, default=None)
    export.add_argument(
        "--python-path", action="append", default=[], help="a folder holding taskset packages"
    )
    export.add_argument("--venv", default=None, help="the verifiers venv")
    args = parser.parse_args(argv)
    rows = load_tasks(
        args.taskset,
        overrides=json.loads(args.taskset_config),
        skip=args.skip,
        limit=args.limit,
        python_path=args.python_path,
        venv=args.venv,
    )
    with open(args.out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    print(f"wrote {len(rows)} rows of taskset {args.taskset!r} to {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
