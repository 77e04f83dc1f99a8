"""The python sandbox against hostile code: every run must end in time and leave the host untouched.

The namespace-only guarantees (no network, host files invisible, nothing written outside) are
asserted where namespaces work and skipped with the reason where they do not; the rlimits/timeout
guarantees are asserted in both modes. The namespace sandbox is also run with interpreters installed
in each way a user may have one (virtualenvs under /tmp and elsewhere, the system interpreter, a
conda-style prefix). tests/test_tool_python_sandbox_hostile.py holds the hostile-code suite.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agent_r1.tools import ToolCall, ToolSet
from agent_r1.tools.python_sandbox import (
    _LAUNCHER,
    Isolation,
    PythonSandbox,
    SandboxLimits,
    SandboxStatus,
    _log_weaker_isolation_once,
    _prepare,
    _supervise,
    namespaces_problem,
    python_tool,
)

# A generous wall clock so that runs expected to succeed do so on a loaded machine; hostile runs are
# stopped by the CPU limit, the output cap or (SHORT) a short wall clock.
LIMITS = SandboxLimits(wall_timeout_s=30.0, cpu_time_s=3, memory_mb=512, max_processes=16)
SHORT = dataclasses.replace(LIMITS, wall_timeout_s=3.0)
NAMESPACES_PROBLEM = namespaces_problem()
needs_namespaces = pytest.mark.skipif(
    NAMESPACES_PROBLEM is not None, reason=f"the namespace sandbox does not work here: {NAMESPACES_PROBLEM}"
)
SYSTEM_PYTHON = Path("/usr/bin/python3")
REPO_ROOT = Path(__file__).resolve().parents[1]


def rlimits_sandbox(limits: SandboxLimits) -> PythonSandbox:
    """The rlimits mode, with an interpreter its unprivileged uid can run (as root, not one under /root)."""
    python = str(SYSTEM_PYTHON) if os.geteuid() == 0 else sys.executable
    try:
        return PythonSandbox(limits, isolation="rlimits", python=python)
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"the rlimits mode cannot run {python} here: {e}")


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(LIMITS)


@pytest.fixture(scope="module", params=["namespaces", "rlimits"])
def any_sandbox(request: pytest.FixtureRequest) -> PythonSandbox:
    """Both modes, for the guarantees that do not depend on namespaces."""
    if request.param == "rlimits":
        return rlimits_sandbox(LIMITS)
    return PythonSandbox(LIMITS)


def test_runs_code_with_stdin_and_files(any_sandbox: PythonSandbox) -> None:
    code = "import helper, sys\nprint(helper.double(int(sys.stdin.read())))"
    result = any_sandbox.run(code, stdin="21", files={"helper.py": "def double(x):\n    return 2 * x\n"})
    assert result.status is SandboxStatus.OK, result
    assert result.stdout == "42\n"
    assert result.exit_code == 0


def test_exception_is_reported_with_traceback(any_sandbox: PythonSandbox) -> None:
    result = any_sandbox.run("1 / 0")
    assert result.status is SandboxStatus.ERROR
    assert result.exit_code == 1
    assert "ZeroDivisionError" in result.stderr
    assert "ZeroDivisionError" in result.render() and "[exit code 1]" in result.render()


def test_infinite_loop_is_killed_at_the_time_limit(any_sandbox: PythonSandbox) -> None:
    start = time.monotonic()
    result = any_sandbox.run("while True:\n    pass")
    assert result.status is SandboxStatus.TIMEOUT
    assert time.monotonic() - start < LIMITS.wall_timeout_s + 5
    assert "time limit" in result.render()


def test_sleeping_code_is_killed_by_the_wall_clock(sandbox: PythonSandbox) -> None:
    # Sleeping uses no CPU time: only the wall-clock limit can stop it.
    result = PythonSandbox(SandboxLimits(wall_timeout_s=1.0)).run("import time\ntime.sleep(600)")
    assert result.status is SandboxStatus.TIMEOUT
    assert result.wall_time_s < 30


def _sandbox_processes() -> str:
    """Host processes running sandboxed code (its argv ends in ``-E -s -B main.py``) or the launcher."""
    pattern = "[-]E -s -B main[.]py|python_sandbox_launcher"
    return subprocess.run(["pgrep", "-af", pattern], capture_output=True, text=True).stdout.strip()


def test_fork_bomb_is_contained_and_cleaned_up(sandbox: PythonSandbox) -> None:
    marker = "forkbomb_marker_7f3a"
    code = (
        f"import os\n# {marker}\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass"
    )
    already_running = set(_sandbox_processes().splitlines())  # e.g. another test run on this host
    result = PythonSandbox(SHORT, isolation=sandbox.isolation.value).run(code)
    assert result.status is SandboxStatus.TIMEOUT
    time.sleep(0.5)
    survivors = set(_sandbox_processes().splitlines()) - already_running
    assert not [line for line in survivors if str(_LAUNCHER) in line]  # this checkout's launcher is gone
    if survivors:
        # The bomb's own processes do not name their checkout: those of another test run on this host
        # (two checkouts' suites side by side each saw the other's) end by that run's time limit,
        # while a survivor of this one forks on forever.
        time.sleep(SHORT.wall_timeout_s + 2.0)
        survivors &= set(_sandbox_processes().splitlines())
    assert not survivors  # no process of the bomb survives the run
    # And the host can still start processes.
    assert subprocess.run(["true"]).returncode == 0


def test_setsid_escape_does_not_survive(sandbox: PythonSandbox) -> None:
    code = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(30)\n"
        "        open('/tmp/escaped', 'w').write('x')\n"
        "    os._exit(0)\n"
        "print('parent done')\n"
    )
    result = sandbox.run(code)
    assert result.status is SandboxStatus.OK
    if sandbox.isolation is Isolation.NAMESPACES:
        # The PID namespace dies with its init: the daemonised grandchild is gone.
        time.sleep(0.3)
        assert subprocess.run(["pgrep", "-f", "time.sleep\\(30\\)"], capture_output=True).stdout == b""


def test_memory_bomb_fails_with_memory_error(any_sandbox: PythonSandbox) -> None:
    code = "chunks = []\nwhile True:\n    chunks.append(bytearray(50 * 2**20))"
    result = any_sandbox.run(code)
    assert result.status is SandboxStatus.ERROR
    assert "MemoryError" in result.stderr


def test_gigabytes_of_output_are_cut_and_the_run_killed(any_sandbox: PythonSandbox) -> None:
    code = "import sys\nblock = 'x' * 2**20\nfor _ in range(4096):\n    sys.stdout.write(block)"
    start = time.monotonic()
    result = any_sandbox.run(code)
    assert result.status is SandboxStatus.OUTPUT_LIMIT
    assert result.truncated
    assert len(result.stdout) == LIMITS.max_output_bytes
    assert time.monotonic() - start < LIMITS.wall_timeout_s + 5


def test_file_size_limit(sandbox: PythonSandbox) -> None:
    limits = dataclasses.replace(LIMITS, max_file_mb=1)
    code = "f = open('big', 'wb')\nf.write(b'x' * (2 * 2**20))\nf.close()"
    result = PythonSandbox(limits).run(code)
    assert result.status is SandboxStatus.ERROR  # SIGXFSZ kills it, or the write fails


def test_each_run_gets_a_fresh_working_directory(sandbox: PythonSandbox) -> None:
    first = sandbox.run("open('left_behind.txt', 'w').write('x')\nimport os\nprint(os.getcwd())")
    second = sandbox.run("import os\nprint(sorted(os.listdir('.')))")
    assert first.ok and second.ok
    assert second.stdout.strip() == "['main.py']"


def test_environment_is_cleared(any_sandbox: PythonSandbox, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AGENT_R1_SECRET_TOKEN", "hunter2")
    result = any_sandbox.run("import os\nprint(sorted(os.environ))")
    assert result.ok
    assert "AGENT_R1_SECRET_TOKEN" not in result.stdout and "hunter2" not in result.stdout


@needs_namespaces
def test_no_network_even_to_the_hosts_loopback(sandbox: PythonSandbox) -> None:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    code = (
        "import socket\n"
        f"for addr in [('127.0.0.1', {port}), ('1.1.1.1', 80)]:\n"
        "    try:\n"
        "        socket.create_connection(addr, timeout=2)\n"
        "        print('connected', addr)\n"
        "    except OSError as e:\n"
        "        print('refused', addr, type(e).__name__)\n"
    )
    try:
        result = sandbox.run(code)
    finally:
        server.close()
    assert result.ok, result
    assert "connected" not in result.stdout
    assert result.stdout.count("refused") == 2


@needs_namespaces
def test_host_files_are_invisible(sandbox: PythonSandbox, tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("the host's secret")
    secret.chmod(0o644)
    os.chmod(tmp_path, 0o755)
    code = (
        "import os\n"
        f"for path in [{str(secret)!r}, '/etc/passwd', '/root', {__file__!r}]:\n"
        "    print(path, os.path.exists(path))\n"
        "print(sorted(os.listdir('/')))\n"
    )
    result = sandbox.run(code)
    assert result.ok, result
    assert "True" not in result.stdout.splitlines()[0]
    assert "/etc/passwd False" in result.stdout
    assert "the host's secret" not in result.stdout
    assert f"{__file__} False" in result.stdout  # the repository is not there either


@needs_namespaces
def test_cannot_write_outside_the_working_directory(sandbox: PythonSandbox, tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o777)
    targets = [str(tmp_path / "pwned"), "/usr/pwned", "/pwned", "/etc/pwned"]
    code = (
        f"for path in {targets!r}:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "        print('wrote', path)\n"
        "    except OSError as e:\n"
        "        print('denied', path, type(e).__name__)\n"
    )
    result = sandbox.run(code)
    assert result.ok, result
    assert "wrote" not in result.stdout
    assert not (tmp_path / "pwned").exists() and not Path("/usr/pwned").exists()


@needs_namespaces
def test_runs_as_unprivileged_user(sandbox: PythonSandbox) -> None:
    result = sandbox.run("import os\nprint(os.getuid(), os.geteuid())")
    assert result.ok
    uid, euid = map(int, result.stdout.split())
    assert uid != 0 and euid != 0


def test_unknown_isolation_is_rejected() -> None:
    with pytest.raises(ValueError, match="choose from"):
        PythonSandbox(isolation="docker")


def test_there_is_no_auto_mode_that_could_pick_a_weaker_one() -> None:
    with pytest.raises(ValueError, match="'auto' is unknown"):
        PythonSandbox(isolation="auto")
    assert PythonSandbox(LIMITS).isolation is Isolation.NAMESPACES  # the default is the strong mode


def test_an_unusable_interpreter_is_refused_with_the_reason(tmp_path: Path) -> None:
    broken = tmp_path / "python"
    broken.write_text("#!/bin/sh\necho 'not a python' >&2\nexit 3\n")
    broken.chmod(0o755)
    with pytest.raises(RuntimeError, match="cannot run code here.*exit 3.*not a python"):
        PythonSandbox(LIMITS, python=str(broken))


def test_the_weaker_mode_is_logged_once_and_recorded_in_each_result(caplog: pytest.LogCaptureFixture) -> None:
    _log_weaker_isolation_once.cache_clear()
    with caplog.at_level(logging.WARNING, logger="agent_r1.tools.python_sandbox"):
        first, second = rlimits_sandbox(LIMITS), rlimits_sandbox(LIMITS)
    warnings = [r for r in caplog.records if "isolation='rlimits'" in r.getMessage()]
    assert len(warnings) == 1
    assert first.run("print(1)").isolation is Isolation.RLIMITS
    assert second.run("print(1)").isolation is Isolation.RLIMITS


# --- interpreters installed anywhere ----------------------------------------------------------------

_SHOW_PREFIX = "import json, os, sys\nprint(json.dumps([sys.prefix, os.getuid(), sorted(os.listdir('.'))]))"


def _make_venv(parent: Path) -> Path:
    """A throwaway virtualenv (no pip) of this test run's base interpreter; returns its python."""
    venv = parent / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    return venv / "bin" / "python"


@pytest.fixture(params=["under_tmp", "outside_tmp"])
def venv_python(request: pytest.FixtureRequest, tmp_path: Path):
    """A virtualenv under /tmp (pytest's tmp_path) and one outside it (/var/tmp or the home directory)."""
    if request.param == "under_tmp":
        yield _make_venv(tmp_path)
        return
    outside = next(p for p in (Path("/var/tmp"), Path.home()) if p.is_dir() and os.access(p, os.W_OK))
    parent = Path(tempfile.mkdtemp(prefix="agent-r1-sandbox-venv-", dir=outside))
    try:
        assert not str(parent).startswith("/tmp/")
        yield _make_venv(parent)
    finally:
        shutil.rmtree(parent)


@needs_namespaces
def test_a_virtualenv_anywhere_runs_in_namespaces(venv_python: Path) -> None:
    result = PythonSandbox(LIMITS, python=str(venv_python)).run(_SHOW_PREFIX)
    assert result.ok, result
    prefix, uid, listing = json.loads(result.stdout)
    assert prefix == str(venv_python.parent.parent)  # the virtualenv itself, not only its base
    assert uid != 0 and listing == ["main.py"]
    assert result.isolation is Isolation.NAMESPACES


@needs_namespaces
def test_the_library_run_from_a_virtualenv_anywhere_keeps_namespaces(venv_python: Path) -> None:
    """The trainer itself runs in the throwaway virtualenv: the default sandbox is still namespaces."""
    script = (
        "import json\n"
        "from agent_r1.tools.python_sandbox import PythonSandbox, SandboxLimits\n"
        "result = PythonSandbox(SandboxLimits(wall_timeout_s=30)).run('import sys; print(sys.prefix)')\n"
        "print(json.dumps([result.isolation.value, result.status.value, result.stdout, result.stderr]))\n"
    )
    run = subprocess.run(
        [str(venv_python), "-c", script],
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO_ROOT), "PATH": os.environ.get("PATH", "/usr/bin:/bin")},
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    isolation, status, stdout, stderr = json.loads(run.stdout)
    assert (isolation, status) == ("namespaces", "ok"), stderr
    assert stdout.strip() == str(venv_python.parent.parent)


@needs_namespaces
@pytest.mark.skipif(not SYSTEM_PYTHON.exists(), reason="no system interpreter at /usr/bin/python3")
def test_the_system_interpreter_runs_in_namespaces() -> None:
    result = PythonSandbox(LIMITS, python=str(SYSTEM_PYTHON)).run(_SHOW_PREFIX)
    assert result.ok, result
    assert json.loads(result.stdout)[0] == "/usr"


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system
        shutil.copy2(source, target)


@needs_namespaces
@pytest.mark.skipif(
    not Path("/usr/bin/python3.11").exists() or not Path("/usr/lib/python3.11/os.py").exists(),
    reason="builds the conda-style prefix from a Debian-style /usr/bin/python3.11 + /usr/lib/python3.11",
)
def test_a_conda_style_prefix_under_tmp_runs_in_namespaces(tmp_path: Path) -> None:
    """A self-contained prefix (bin/python3.11 + lib/python3.11) at a path nothing else mounts.

    The interpreter finds its standard library relative to itself, as conda's does; it is built from
    the system interpreter's files (hard links where possible), so only the prefix makes it work.
    """
    prefix = tmp_path / "conda-env"
    (prefix / "bin").mkdir(parents=True)
    shutil.copy2("/usr/bin/python3.11", prefix / "bin" / "python3.11")
    shutil.copytree("/usr/lib/python3.11", prefix / "lib" / "python3.11", copy_function=_link_or_copy)
    result = PythonSandbox(LIMITS, python=str(prefix / "bin" / "python3.11")).run(
        _SHOW_PREFIX + "\nimport json as j, decimal\nprint(j.__file__)"
    )
    assert result.ok, result
    first, second = result.stdout.splitlines()
    assert json.loads(first)[0] == str(prefix)
    assert second.startswith(str(prefix / "lib" / "python3.11"))


def test_python_tool_returns_output_and_survives_hostile_calls(sandbox: PythonSandbox) -> None:
    tools = ToolSet([python_tool(sandbox)])
    calls = [
        ToolCall("python", {"code": "print(sum(range(10)))"}, "call_0"),
        ToolCall("python", {"code": "while True: pass"}, "call_1"),
        ToolCall("python", {"code": "raise ValueError('bad input')"}, "call_2"),
        ToolCall("python", {"source": "print(1)"}, "call_3"),
    ]
    results = asyncio.run(tools.execute(calls))
    assert results[0].content == "45\n" and not results[0].is_error
    assert "time limit exceeded" in results[1].content
    assert "ValueError: bad input" in results[2].content
    assert results[3].is_error and "unknown argument 'source'" in results[3].content
    assert tools["python"].schema()["function"]["parameters"]["required"] == ["code"]


def _world_traversable(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path, *path.parents])


@pytest.mark.skipif(
    os.geteuid() != 0
    or shutil.which("setpriv") is None
    or not SYSTEM_PYTHON.exists()
    or not _world_traversable(Path(_LAUNCHER).parent),
    reason="needs root (to become nobody with setpriv), a system /usr/bin/python3 and a world-readable checkout",
)
def test_unprivileged_caller_gets_the_same_isolation_through_a_user_namespace() -> None:
    """The non-root path of the launcher: it maps a non-zero uid in a new user namespace."""
    base = Path(tempfile.mkdtemp(prefix="agent-r1-sandbox-test-"))
    try:
        code = (
            "import os, socket\n"
            "print(os.getuid(), os.path.exists('/etc/passwd'), sorted(os.listdir('/')))\n"
            "try:\n"
            "    socket.create_connection(('1.1.1.1', 80), timeout=2)\n"
            "    print('connected')\n"
            "except OSError:\n"
            "    print('no network')\n"
        )
        config = _prepare(base, code, "", {}, LIMITS, Isolation.NAMESPACES, str(SYSTEM_PYTHON), uid=None)
        for path in [base, *base.rglob("*")]:
            path.chmod(0o755)
        unprivileged = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(SYSTEM_PYTHON)]
        result = _supervise(
            [*unprivileged, "-I", "-S", str(_LAUNCHER), str(config)], LIMITS, Isolation.NAMESPACES
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if result.status is SandboxStatus.SETUP_FAILED:
        pytest.skip(f"unprivileged user namespaces are disabled here: {result.stderr.strip()}")
    assert result.ok, result
    uid, passwd_visible, *_ = result.stdout.split(maxsplit=2)
    assert uid == "1000" and passwd_visible == "False"
    assert result.stdout.rstrip().endswith("no network")
