"""Hostile code against the namespace sandbox: each case ends within its limits and the host is unchanged.

Every run prints the uid it ran as first, so that the test can check afterwards that no process of
that uid is left on the host; files the code tries to leave behind carry a marker that is searched
for in the host's writable places. Limits are small (a few processes, a few MB of tmpfs, seconds of
wall clock) so that a containment bug costs the machine little; the bombs run only after a bounded
probe of the same limit has shown that it bites.

The weaker ``rlimits`` mode (only where the dedicated-uid process limit holds, i.e. as root) is run
through the cases it claims to contain: process count, descendants killed, no signals to the host.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_r1.tools.python_sandbox import (
    Isolation,
    PythonSandbox,
    SandboxLimits,
    SandboxResult,
    SandboxStatus,
    namespaces_problem,
)

LIMITS = SandboxLimits(
    wall_timeout_s=20.0, cpu_time_s=3, memory_mb=512, max_processes=12, max_open_files=32, workdir_mb=4
)
SHORT = dataclasses.replace(LIMITS, wall_timeout_s=3.0)
PROBLEM = namespaces_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=f"the namespace sandbox does not work: {PROBLEM}")
SYSTEM_PYTHON = "/usr/bin/python3"
HOST_WRITABLE = [Path("/tmp"), Path("/var/tmp"), Path("/dev/shm")]


@pytest.fixture(scope="module")
def sandbox() -> PythonSandbox:
    return PythonSandbox(LIMITS)


def processes_of(uid: int) -> list[str]:
    """Host processes whose real uid is ``uid`` (pid and command line)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            status = (entry / "status").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError):
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) == uid:
            found.append(f"{entry.name}: {cmdline}")
    return found


def files_named(marker: str) -> list[Path]:
    found = []
    for top in HOST_WRITABLE:
        if top.is_dir():
            for directory, _, names in os.walk(top, onerror=lambda e: None):
                found += [Path(directory, n) for n in names if marker in n]
                found += [Path(directory)] if marker in directory else []
    return found


def run_hostile(sandbox: PythonSandbox, body: str, **kwargs) -> tuple[SandboxResult, list[str]]:
    """Run ``body`` after a line that prints the uid; return the result and the lines after it.

    Asserts the host side: nothing of that uid is left running afterwards.
    """
    result = sandbox.run("import os\nprint(os.getuid(), flush=True)\n" + body, **kwargs)
    uid_line, *lines = result.stdout.splitlines()
    uid = int(uid_line)
    assert uid != 0
    assert processes_of(uid) == []
    return result, lines


def test_proc_shows_only_the_sandbox_and_leads_nowhere(sandbox: PythonSandbox) -> None:
    # host pids, never 1 or 2: those are the namespace's own (a pytest orphaned under init has ppid 1)
    host = [
        f"/proc/{pid}/{name}"
        for pid in {os.getpid(), os.getppid()} - {1, 2}
        for name in ("environ", "cmdline")
    ]
    code = f"""
import json, os
pids = sorted(int(p) for p in os.listdir('/proc') if p.isdigit())
probes = {{}}
for path in ['/proc/1/root/etc/passwd', '/proc/self/root/etc/passwd', '/proc/1/cwd/../../etc/passwd',
             '/proc/sys/kernel/hostname', '/proc/1/environ', *{host!r}]:
    try:
        probes[path] = open(path, 'rb').read(200).decode(errors='replace')
    except OSError as e:
        probes[path] = type(e).__name__
for path in ['/proc/sys/kernel/hostname', '/proc/sysrq-trigger', '/proc/sys/vm/drop_caches']:
    try:
        open(path, 'w').write('h')
        probes['write ' + path] = 'WROTE'
    except OSError as e:
        probes['write ' + path] = type(e).__name__
print(json.dumps([pids, os.readlink('/proc/self/root'), probes]))
"""
    hostname = Path("/proc/sys/kernel/hostname").read_text()
    result, lines = run_hostile(sandbox, code)
    assert result.ok, result
    pids, init_root, probes = json.loads(lines[0])
    assert pids == [1, 2]  # the namespace's init and the code itself
    assert init_root == "/"  # the code's root is the sandbox's, not a way out
    assert all(probes[p] in ("FileNotFoundError", "PermissionError") for p in probes if "passwd" in p)
    assert host and {path: probes[path] for path in host} == dict.fromkeys(host, "FileNotFoundError")
    assert probes["/proc/1/environ"] in ("", "PermissionError")  # the launcher passes no environment
    assert "WROTE" not in probes.values()
    assert Path("/proc/sys/kernel/hostname").read_text() == hostname


def test_signals_reach_no_host_process(sandbox: PythonSandbox) -> None:
    canary = subprocess.Popen(["sleep", "120"])
    try:
        code = f"""
import os, signal
for pid in [{canary.pid}, {os.getpid()}, {os.getppid()}, os.getppid(), 1]:
    try:
        os.kill(pid, signal.SIGKILL)
        print('sent', pid)
    except OSError as e:
        print('failed', pid, type(e).__name__)
try:
    os.kill(-1, signal.SIGKILL)  # everything this process may signal
except OSError as e:
    print('kill -1 failed', type(e).__name__)
print('still here')
"""
        result, lines = run_hostile(sandbox, code)
        assert canary.poll() is None  # the host process is alive
    finally:
        canary.kill()
        canary.wait()
    assert result.ok, result
    assert f"failed {canary.pid} ProcessLookupError" in lines  # host pids do not exist in there
    assert lines[-1] == "still here"


def test_a_daemon_holding_the_output_pipes_is_killed_when_the_code_ends(sandbox: PythonSandbox) -> None:
    code = """
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)  # holds stdout and stderr open
        print('daemon woke up')
    os._exit(0)
print('parent done')
"""
    result, lines = run_hostile(sandbox, code)
    # OK, not TIMEOUT: the run ended when the code did, not when the daemon's pipes closed.
    assert result.status is SandboxStatus.OK, result
    assert lines == ["parent done"]


# Each new process leaves the process group first, so that killing the group alone would not end it.
FORK_BOMB = """
while True:
    try:
        if os.fork() == 0:
            os.setsid()
    except OSError:
        pass
"""
THREAD_BOMB = """
import threading, time
while True:
    try:
        threading.Thread(target=time.sleep, args=(600,)).start()
    except RuntimeError:
        pass
"""


def _bounded_spawn(n: int, kind: str) -> str:
    start = (
        "os.fork() == 0 and (time.sleep(5), os._exit(0))"
        if kind == "process"
        else "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()"
    )
    return f"""
import os, threading, time
started = 0
for _ in range({n}):
    try:
        {start}
        started += 1
    except (OSError, RuntimeError):
        pass
print(started)
"""


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_the_process_limit_bites_before_any_bomb(sandbox: PythonSandbox, kind: str) -> None:
    result, lines = run_hostile(sandbox, _bounded_spawn(50, kind))
    assert result.ok, result
    assert int(lines[0]) < LIMITS.max_processes  # processes and threads count against one limit


@pytest.mark.parametrize("kind", ["process", "thread"])
def test_fork_and_thread_bombs_are_contained(kind: str) -> None:
    probe, lines = run_hostile(PythonSandbox(SHORT), _bounded_spawn(50, kind))
    assert probe.ok and int(lines[0]) < SHORT.max_processes  # checked again right before the bomb
    result, _ = run_hostile(PythonSandbox(SHORT), FORK_BOMB if kind == "process" else THREAD_BOMB)
    assert result.status in (SandboxStatus.TIMEOUT, SandboxStatus.ERROR), result
    # The caller can still start threads and processes.
    thread = threading.Thread(target=lambda: None)
    thread.start()
    thread.join()
    assert subprocess.run(["true"]).returncode == 0


def test_file_descriptor_exhaustion_stays_inside(sandbox: PythonSandbox) -> None:
    before = len(os.listdir("/proc/self/fd"))
    code = """
files = []
try:
    while True:
        files.append(open('/dev/null'))
except OSError as e:
    print(len(files), type(e).__name__)
"""
    result, lines = run_hostile(sandbox, code)
    assert result.ok, result
    count, error = lines[0].split()
    assert error == "OSError" and int(count) < LIMITS.max_open_files
    assert len(os.listdir("/proc/self/fd")) == before


def test_filling_the_working_directory_and_tmp_stops_at_one_small_limit(sandbox: PythonSandbox) -> None:
    marker = f"fill-{uuid.uuid4().hex}"
    code = f"""
import errno
written = 0
for directory in ['/sandbox', '/tmp', '/dev/shm', '/var/tmp']:
    try:
        with open(directory + '/{marker}', 'wb') as f:
            while True:
                f.write(b'x' * 65536)
                f.flush()
                written += 65536
    except OSError as e:
        print(directory, errno.errorcode[e.errno])
print(written)
"""
    result, lines = run_hostile(sandbox, code)
    assert result.ok, result
    assert lines[:2] == ["/sandbox ENOSPC", "/tmp ENOSPC"]  # /tmp is full already: one shared tmpfs
    assert lines[2] in ("/dev/shm ENOENT", "/dev/shm EROFS") and lines[3] in (
        "/var/tmp ENOENT",
        "/var/tmp EROFS",
    )
    assert int(lines[4]) <= LIMITS.workdir_mb * 2**20
    assert files_named(marker) == []


def _host_addresses() -> list[str]:
    """This machine's non-loopback IPv4 addresses (where a service listening on 0.0.0.0 answers)."""
    out = subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
    return [a for a in out if ":" not in a and not a.startswith("127.")]


def test_no_network_to_any_address(sandbox: PythonSandbox) -> None:
    server = socket.socket()
    server.bind(("0.0.0.0", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    targets = [(a, port) for a in ["127.0.0.1", *_host_addresses()]] + [("1.1.1.1", 53), ("8.8.8.8", 443)]
    code = f"""
import socket
print(sorted(name for _, name in socket.if_nameindex()))
for addr in {targets!r}:
    try:
        socket.create_connection(addr, timeout=2)
        print('connected', addr)
    except OSError as e:
        print('refused', addr, type(e).__name__)
try:
    socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('1.1.1.1', 53))
    print('sent udp')
except OSError as e:
    print('udp refused', type(e).__name__)
"""
    try:
        result, lines = run_hostile(sandbox, code)
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the host's service
    finally:
        server.close()
    assert result.ok, result
    assert lines[0] == "['lo']"
    assert not any(line.startswith(("connected", "sent")) for line in lines)
    assert sum(line.startswith("refused") for line in lines) == len(targets)


def test_host_secrets_are_out_of_reach(sandbox: PythonSandbox, tmp_path: Path, monkeypatch) -> None:
    secret = f"secret-{uuid.uuid4().hex}"
    planted = tmp_path / "credentials"
    planted.write_text(secret)
    planted.chmod(0o644)
    tmp_path.chmod(0o755)
    monkeypatch.setenv("AGENT_R1_API_KEY", secret)
    files = ["/etc/shadow", "/etc/passwd", "/root/.ssh/id_rsa", "/root/.bash_history", str(planted)]
    directories = ["/root", str(Path.home()), "/home", "/etc"]
    code = f"""
import json, os
print(os.environ.get('AGENT_R1_API_KEY'))
for path in {files!r}:
    try:
        print('READ', path, open(path).read())
    except OSError as e:
        print('denied', path, type(e).__name__)
listings = {{}}
for path in {directories!r}:
    try:
        listings[path] = os.listdir(path)
    except OSError as e:
        listings[path] = type(e).__name__
print(json.dumps(listings))
"""
    result, lines = run_hostile(sandbox, code)
    assert result.ok, result
    assert lines[0] == "None"
    assert not any(line.startswith("READ") for line in lines), lines
    assert secret not in result.stdout + result.stderr
    # A directory is there only as the way to a mounted interpreter prefix, holding nothing else.
    scaffold = {part for p in {sys.prefix, sys.base_prefix} for part in Path(p).parts} | {"ld.so.cache"}
    for path, listing in json.loads(lines[-1]).items():
        assert listing == "FileNotFoundError" or set(listing) <= scaffold, (path, listing)


def _tree_digest(prefix: Path) -> str:
    """Names, sizes and mtimes under the interpreter's prefix (the code sees it, read-only)."""
    digest = hashlib.sha256()
    for directory, _, names in sorted(os.walk(prefix)):
        for name in sorted(names):
            stat = os.lstat(os.path.join(directory, name))
            digest.update(f"{directory}/{name} {stat.st_size} {stat.st_mtime_ns}".encode())
    return digest.hexdigest()


def test_no_write_reaches_the_host(sandbox: PythonSandbox, tmp_path: Path) -> None:
    marker = f"pwned-{uuid.uuid4().hex}"
    open_dir = tmp_path / "world-writable"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    tmp_path.chmod(0o755)
    before = _tree_digest(Path(sys.prefix))
    targets = [
        str(open_dir / marker),
        f"{sys.prefix}/{marker}",
        f"{sys.prefix}/bin/{marker}",
        f"/usr/{marker}",
        f"/etc/{marker}",
        f"/{marker}",
        f"/dev/{marker}",
    ]
    code = f"""
import ctypes, os, sys
for path in {targets!r}:
    try:
        open(path, 'w').write('x')
        print('WROTE', path)
    except OSError as e:
        print('denied', path, type(e).__name__)
try:
    open(sys.executable, 'ab')
    print('WROTE the interpreter')
except OSError as e:
    print('denied interpreter', type(e).__name__)
libc = ctypes.CDLL(None, use_errno=True)
for args in [(b'none', b'/usr', None, 32, None), (b'tmpfs', b'/etc', b'tmpfs', 0, None)]:
    print('mount', libc.mount(*args), ctypes.get_errno())  # remount /usr read-write; mount over /etc
print('umount', libc.umount2(b'/usr', 2), ctypes.get_errno())
"""
    result, lines = run_hostile(sandbox, code)
    assert result.ok, result
    assert not any(line.startswith("WROTE") for line in lines), lines
    eperm = f"-1 {errno.EPERM}"
    assert [line for line in lines if line.startswith(("mount", "umount"))] == [
        f"mount {eperm}",
        f"mount {eperm}",
        f"umount {eperm}",
    ]
    assert list(open_dir.iterdir()) == [] and files_named(marker) == []
    assert _tree_digest(Path(sys.prefix)) == before
    assert not Path(f"/usr/{marker}").exists() and not Path(f"/etc/{marker}").exists()


# --- the weaker rlimits mode: only what it claims to contain ------------------------------------


@pytest.fixture(scope="module")
def rlimits_sandbox() -> Iterator[PythonSandbox]:
    if os.geteuid() != 0:
        pytest.skip(
            "without root there is no dedicated uid, so the process limit counts the caller's processes"
        )
    try:
        sandbox = PythonSandbox(LIMITS, isolation="rlimits", python=SYSTEM_PYTHON)
    except (RuntimeError, ValueError) as e:
        pytest.skip(f"the rlimits mode cannot run {SYSTEM_PYTHON} here: {e}")
    yield sandbox


def test_rlimits_mode_contains_processes_signals_and_daemons(rlimits_sandbox: PythonSandbox) -> None:
    result, lines = run_hostile(rlimits_sandbox, _bounded_spawn(50, "process"))
    assert result.ok and int(lines[0]) < LIMITS.max_processes, result  # the limit holds for root
    canary = subprocess.Popen(["sleep", "120"])
    try:
        code = f"""
import os, signal, time
for pid in [{canary.pid}, os.getppid(), {os.getpid()}]:
    try:
        os.kill(pid, signal.SIGKILL)
        print('sent', pid)
    except OSError as e:
        print('failed', type(e).__name__)
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(120)
    os._exit(0)
print('done')
"""
        result, lines = run_hostile(rlimits_sandbox, code)
        assert canary.poll() is None
    finally:
        canary.kill()
        canary.wait()
    assert result.status is SandboxStatus.OK and result.isolation is Isolation.RLIMITS, result
    assert lines == ["failed PermissionError"] * 3 + ["done"]  # and the daemon is gone (run_hostile)


def test_rlimits_mode_fork_bomb_is_contained(rlimits_sandbox: PythonSandbox) -> None:
    short = PythonSandbox(SHORT, isolation="rlimits", python=SYSTEM_PYTHON)
    probe, lines = run_hostile(short, _bounded_spawn(50, "process"))
    assert probe.ok and int(lines[0]) < SHORT.max_processes  # never bomb before the limit is seen to hold
    result, _ = run_hostile(short, FORK_BOMB)
    assert result.status is SandboxStatus.TIMEOUT, result


def test_rlimits_mode_cannot_read_root_only_files(rlimits_sandbox: PythonSandbox) -> None:
    code = "try:\n    print('READ', open('/etc/shadow').read())\nexcept OSError as e:\n"
    code += "    print(type(e).__name__)\n"
    result, lines = run_hostile(rlimits_sandbox, code)
    assert lines == ["PermissionError"], result
