"""Run model-written Python in a sandboxed subprocess, and the ``python`` tool built on it.

Every run gets a fresh process in a new session, a fresh working directory, a cleared environment,
rlimits (CPU time, address space, processes, file size, open files), a wall-clock timeout after which
everything it started is killed, and output read with a cap (never more than ``max_output_bytes`` per
stream is buffered; going over kills the run). In the default ``isolation="namespaces"`` the code
also runs with no network, in its own PID namespace, inside a read-only view of the interpreter and
system libraries only — the host's files are not there — as an unprivileged uid, with a size-limited
tmpfs as working directory; where that cannot be built, ``PythonSandbox`` refuses with the reason.
The weaker ``isolation="rlimits"`` happens only when asked for by name; it is logged once and recorded
in every ``SandboxResult.isolation``. See ``agent_r1/tools/python_sandbox_launcher.py`` for how, and
``docs/tool_library.md`` for exactly what each mode does and does not contain.

    sandbox = PythonSandbox(SandboxLimits(wall_timeout_s=5))
    result = sandbox.run("print(2 + 2)")          # SandboxResult(stdout="4\\n", status=OK, ...)
    python = python_tool(sandbox)                 # a Tool named "python" taking {"code": str}
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from agent_r1.tools.base import Tool

__all__ = [
    "Isolation",
    "PythonSandbox",
    "SandboxLimits",
    "SandboxResult",
    "SandboxStatus",
    "namespaces_problem",
    "python_tool",
]

_LAUNCHER = Path(__file__).with_name("python_sandbox_launcher.py")
_EXIT_SETUP_FAILED = 125
_FIRST_SANDBOX_UID = 420_000  # unprivileged uids with no account; one per concurrent run (see _lease_uid)
_UID_POOL = 4096
_uid_counter = itertools.count()
_STOP_GRACE_S = 5.0  # how long the launcher may take to kill the code's processes on SIGTERM
logger = logging.getLogger(__name__)


class Isolation(str, Enum):
    NAMESPACES = "namespaces"  # rlimits + no network + private PID/mount namespaces + read-only view
    RLIMITS = "rlimits"  # rlimits + dedicated uid (as root) + subreaper kill + fresh directory only


class SandboxStatus(str, Enum):
    OK = "ok"  # exited with status 0
    ERROR = "error"  # exited with another status (an exception, sys.exit(1), a signal)
    TIMEOUT = "timeout"  # wall-clock or CPU time limit reached; everything it started was killed
    OUTPUT_LIMIT = "output_limit"  # wrote more than max_output_bytes; everything it started was killed
    SETUP_FAILED = "setup_failed"  # the sandbox itself could not be built (stderr says why)


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits of one run. Memory is address space (RLIMIT_AS), so count libraries too."""

    wall_timeout_s: float = 10.0
    cpu_time_s: int = 10
    memory_mb: int = 1024
    max_processes: int = 32  # RLIMIT_NPROC (processes and threads) of the run's own uid
    max_file_mb: int = 16  # RLIMIT_FSIZE: the largest file the code may write
    max_open_files: int = 64
    max_output_bytes: int = 64_000  # per stream (stdout, stderr)
    workdir_mb: int = 64  # tmpfs size behind the working directory and /tmp (namespaces only)

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value > 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {value!r}")

    def rlimits(self) -> dict[str, tuple[int, int]]:
        """(soft, hard) per rlimit. CPU: SIGXCPU at the soft limit, SIGKILL a second later."""
        return {
            "RLIMIT_CPU": (int(self.cpu_time_s), int(self.cpu_time_s) + 1),
            "RLIMIT_AS": (self.memory_mb * 2**20,) * 2,
            "RLIMIT_NPROC": (self.max_processes,) * 2,
            "RLIMIT_FSIZE": (self.max_file_mb * 2**20,) * 2,
            "RLIMIT_NOFILE": (self.max_open_files,) * 2,
            "RLIMIT_CORE": (0, 0),
        }


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None  # None when the run was killed (timeout, output limit)
    status: SandboxStatus
    isolation: Isolation  # what contained this run (see docs/tool_library.md)
    wall_time_s: float
    truncated: bool = False  # stdout or stderr was cut at max_output_bytes

    @property
    def ok(self) -> bool:
        return self.status is SandboxStatus.OK

    def render(self) -> str:
        """The text a model reads: stdout, stderr and, unless it succeeded, why it did not."""
        parts = [self.stdout] if self.stdout else []
        if self.stderr:
            parts.append(f"[stderr]\n{self.stderr}")
        if self.status is SandboxStatus.TIMEOUT:
            parts.append(f"[killed: time limit exceeded after {self.wall_time_s:.1f}s]")
        elif self.status is SandboxStatus.OUTPUT_LIMIT:
            parts.append("[killed: output limit exceeded; output truncated]")
        elif self.status is SandboxStatus.SETUP_FAILED:
            parts.append("[the sandbox could not start; this is not the code's fault]")
        elif self.status is SandboxStatus.ERROR:
            parts.append(f"[exit code {self.exit_code}]")
        return "\n".join(parts) if parts else "[no output]"


@functools.cache
def _read_only_paths(python: str) -> tuple[str, ...]:
    """What the code may see (read-only): the interpreter, its prefixes and the system libraries.

    The prefixes are asked of ``python`` itself, run as the sandbox runs it, because only it knows
    them: a virtualenv's ``pyvenv.cfg`` names a base installation elsewhere, and a conda-style prefix
    is wherever it was unpacked.
    """
    query = (
        "import json, sys\n"
        "print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))"
    )
    try:
        answer = subprocess.run(
            [python, "-E", "-s", "-c", query], capture_output=True, text=True, env={}, timeout=60
        )
        prefixes = json.loads(answer.stdout) if answer.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError) as e:
        raise ValueError(f"PythonSandbox python={python!r} cannot be run: {e}") from e
    if prefixes is None:
        raise ValueError(
            f"PythonSandbox python={python!r} cannot be run "
            f"(exit {answer.returncode}): {answer.stderr[-500:]}"
        )
    paths = ["/usr", "/bin", "/lib", "/lib32", "/lib64", "/libx32", "/sbin", "/etc/ld.so.cache"]
    paths += [python, os.path.realpath(python), *prefixes]
    covered: list[str] = []
    for path in paths:  # keep each path once, and none that lies inside another one
        if path != "/" and not any(path == c or path.startswith(c.rstrip("/") + "/") for c in covered):
            covered.append(path)
    return tuple(covered)


@contextlib.contextmanager
def _lease_uid() -> Iterator[int]:
    """A sandbox uid that no other run on this machine uses until the block ends.

    The lease is an abstract Unix socket named after the uid: the kernel frees it when its holder
    exits, however it ends, and two trainer processes whose start points collide simply move on.
    """
    start = os.getpid() * 64 + next(_uid_counter)
    for offset in range(_UID_POOL):
        uid = _FIRST_SANDBOX_UID + (start + offset) % _UID_POOL
        lease = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            lease.bind(f"\0agent-r1-sandbox-uid-{uid}")
        except OSError:
            lease.close()
            continue
        try:
            yield uid
        finally:
            lease.close()
        return
    raise RuntimeError(f"all {_UID_POOL} sandbox uids are in use by concurrent runs")


class PythonSandbox:
    """Runs Python source in a fresh sandboxed process per call (thread-safe; runs may overlap).

    ``isolation``: "namespaces" (the default; refuses with the reason where it cannot be built) or
    "rlimits" (weaker — see docs/tool_library.md — used only when asked for by name, and logged).
    ``python``: the interpreter that runs the code (default: this one, so the code can import what is
    installed here, read-only) — any installation: a virtualenv anywhere, a system or conda-style one.
    """

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        *,
        isolation: str = "namespaces",
        python: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.python = python or sys.executable
        choices = tuple(i.value for i in Isolation)
        if isolation not in choices:
            raise ValueError(f"PythonSandbox isolation {isolation!r} is unknown; choose from {choices}")
        self.isolation = Isolation(isolation)
        problem = _probe(self.isolation, self.python)
        if problem is not None:
            if self.isolation is Isolation.NAMESPACES:
                problem += "; isolation='rlimits' would run it with less containment (docs/tool_library.md)"
            elif os.geteuid() == 0:
                problem += (
                    " (as root, 'rlimits' runs the code as an unprivileged uid, which must be able to"
                    " run the interpreter)"
                )
            raise RuntimeError(
                f"PythonSandbox(isolation={isolation!r}, python={self.python!r}) cannot run code here: "
                f"{problem}"
            )
        if self.isolation is Isolation.RLIMITS:
            _log_weaker_isolation_once()

    def run(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None) -> SandboxResult:
        """Run ``code`` as ``main.py``; ``files`` are written beside it, ``stdin`` is its input."""
        return _run(code, stdin, files or {}, self.limits, self.isolation, self.python)

    async def arun(self, code: str, *, stdin: str = "", files: dict[str, str] | None = None) -> SandboxResult:
        return await asyncio.to_thread(self.run, code, stdin=stdin, files=files)


@functools.cache
def _log_weaker_isolation_once() -> None:
    logger.warning(
        "PythonSandbox runs model code with isolation='rlimits': no namespaces, so the code shares the "
        "host's network and can read every world-readable file and write to world-writable directories "
        "(see docs/tool_library.md); each SandboxResult records isolation=rlimits"
    )


def namespaces_problem(python: str | None = None) -> str | None:
    """None when the namespace sandbox works here with ``python`` (default: this one), else why not."""
    return _probe(Isolation.NAMESPACES, python or sys.executable)


_WORKING: set[tuple[Isolation, str]] = set()  # (mode, interpreter) pairs whose probe succeeded


def _probe(isolation: Isolation, python: str) -> str | None:
    """Why ``isolation`` cannot run code with ``python`` here, or None: runs ``print(1)`` in it.

    Only a success is remembered; a failure (perhaps a machine too loaded to start it in time) is
    probed again by the next sandbox that asks.
    """
    if (isolation, python) in _WORKING:
        return None
    try:
        result = _run("print(1)", "", {}, SandboxLimits(wall_timeout_s=30), isolation, python)
    except (OSError, ValueError) as e:
        return str(e)
    if result.ok and result.stdout.strip() == "1":
        _WORKING.add((isolation, python))
        return None
    return result.stderr.strip() or f"the probe ended with status {result.status.value}"


def _run(
    code: str,
    stdin: str,
    files: dict[str, str],
    limits: SandboxLimits,
    isolation: Isolation,
    python: str,
) -> SandboxResult:
    base = Path(tempfile.mkdtemp(prefix="agent-r1-sandbox-"))
    try:
        # As root, a uid of its own per run: RLIMIT_NPROC does not apply to root.
        with _lease_uid() if os.geteuid() == 0 else contextlib.nullcontext() as uid:
            config = _prepare(base, code, stdin, files, limits, isolation, python, uid)
            launcher = [sys.executable, "-I", "-S", str(_LAUNCHER), str(config)]
            return _supervise(launcher, limits, isolation)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _prepare(
    base: Path,
    code: str,
    stdin: str,
    files: dict[str, str],
    limits: SandboxLimits,
    isolation: Isolation,
    python: str,
    uid: int | None,
) -> Path:
    """Write the run's input files and the launcher's config under ``base``; return the config's path."""
    input_dir = base / "work"
    input_dir.mkdir()
    for name, content in {**files, "main.py": code}.items():
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"sandbox file name {name!r} must be a plain file name")
        (input_dir / name).write_text(content, encoding="utf-8")
    (base / "stdin").write_text(stdin, encoding="utf-8")
    (base / "stdin").chmod(0o600)  # the launcher opens it before dropping privileges
    (base / "root").mkdir()
    (base / "scratch").mkdir()
    if uid is not None and isolation is Isolation.RLIMITS:
        base.chmod(0o711)  # the code's uid must reach its working directory (and list nothing else)
    config = {
        "mode": isolation.value,
        "input_dir": str(input_dir),
        "stdin_path": str(base / "stdin"),
        "new_root": str(base / "root"),
        "scratch": str(base / "scratch"),
        "read_only": _read_only_paths(python) if isolation is Isolation.NAMESPACES else [],
        "workdir_bytes": limits.workdir_mb * 2**20,
        "uid": uid,
        "rlimits": limits.rlimits(),
        # -E -s rather than -I, which would also hide main.py's directory from imports.
        "argv": [python, "-E", "-s", "-B", "main.py"],
        "env": {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONIOENCODING": "utf-8",
            "PYTHONUNBUFFERED": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        },
    }
    (base / "config.json").write_text(json.dumps(config))
    (base / "config.json").chmod(0o600)
    return base / "config.json"


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, signal.SIGKILL)


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End a run early: ask the launcher to kill everything the code started and to wait until it
    is gone (descendants may have left the process group), and kill its group if it does not."""
    with contextlib.suppress(ProcessLookupError):
        process.send_signal(signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=_STOP_GRACE_S)
    _kill_group(process)


def _supervise(argv: list[str], limits: SandboxLimits, isolation: Isolation) -> SandboxResult:
    """Start the launcher in a new session; read its output with a cap until it ends or time runs out."""
    start = time.monotonic()
    deadline = start + limits.wall_timeout_s
    process = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        env={},
        cwd="/",
    )
    assert process.stdout is not None and process.stderr is not None
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    buffers = {out_fd: bytearray(), err_fd: bytearray()}
    status: SandboxStatus | None = None
    truncated = False
    with selectors.DefaultSelector() as selector:
        for stream in (process.stdout, process.stderr):
            os.set_blocking(stream.fileno(), False)
            selector.register(stream, selectors.EVENT_READ)
        try:
            while selector.get_map() and status is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    status = SandboxStatus.TIMEOUT
                    break
                for key, _ in selector.select(timeout=remaining):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        selector.unregister(key.fileobj)
                        continue
                    buffer = buffers[key.fd]
                    buffer += chunk
                    if len(buffer) > limits.max_output_bytes:
                        del buffer[limits.max_output_bytes :]
                        truncated = True
                        status = SandboxStatus.OUTPUT_LIMIT
        finally:
            if status is not None:
                _stop(process)
            try:
                exit_code = process.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
            except subprocess.TimeoutExpired:
                # The launcher outlived its output: stop it (a namespace dies with it).
                status = SandboxStatus.TIMEOUT
                _stop(process)
                exit_code = process.wait()
            _kill_group(process)  # anything left in the group
            process.stdout.close()
            process.stderr.close()

    stdout = buffers[out_fd].decode("utf-8", "replace")
    stderr = buffers[err_fd].decode("utf-8", "replace")
    if status is None:
        if exit_code == 0:
            status = SandboxStatus.OK
        elif exit_code in (128 + signal.SIGXCPU, -signal.SIGXCPU):
            status = SandboxStatus.TIMEOUT
        elif exit_code == _EXIT_SETUP_FAILED and stderr.startswith("sandbox setup failed"):
            status = SandboxStatus.SETUP_FAILED
        else:
            status = SandboxStatus.ERROR
    return SandboxResult(
        stdout=stdout,
        stderr=stderr,
        exit_code=None if status in (SandboxStatus.TIMEOUT, SandboxStatus.OUTPUT_LIMIT) else exit_code,
        status=status,
        isolation=isolation,
        wall_time_s=time.monotonic() - start,
        truncated=truncated,
    )


class PythonTool(Tool):
    """The ``python`` tool: runs the model's code in a ``PythonSandbox``; returns what it printed."""

    def __init__(self, sandbox: PythonSandbox | None = None, *, name: str = "python") -> None:
        self.sandbox = sandbox or PythonSandbox()
        super().__init__(
            name,
            "Run a Python 3 program in a sandbox (no network, no files kept between calls) and return "
            "what it printed. Use print() to see values.",
            {
                "type": "object",
                "properties": {"code": {"type": "string", "description": "the Python program to run"}},
                "required": ["code"],
                "additionalProperties": False,
            },
            # The sandbox enforces its own wall timeout; this is only a backstop.
            timeout=self.sandbox.limits.wall_timeout_s + 30.0,
        )

    async def run(self, arguments: dict[str, Any]) -> str:
        result = await self.sandbox.arun(arguments["code"])
        if result.status is SandboxStatus.SETUP_FAILED:
            raise RuntimeError(f"the python sandbox could not start: {result.stderr.strip()}")
        return result.render()


def python_tool(sandbox: PythonSandbox | None = None, *, name: str = "python") -> Tool:
    """The ``python`` tool (a ``PythonTool``) over ``sandbox`` (default limits when None)."""
    return PythonTool(sandbox, name=name)
