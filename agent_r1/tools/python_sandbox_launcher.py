"""The first process inside a Python sandbox: it builds the cage, then execs the model's code.

Run as ``python -I -S python_sandbox_launcher.py CONFIG.json`` by ``agent_r1.tools.python_sandbox``; it
imports nothing but the standard library. Two modes:

- ``namespaces``: unshare new mount, network, PID, IPC and UTS namespaces (plus a user namespace when
  not root), fork the PID namespace's init, and in it: mount a read-only tmpfs root holding a
  size-limited tmpfs shown as the working directory ``/sandbox`` and as ``/tmp`` (one size limit for
  both), ``/dev/{null,zero,urandom,random}``, a fresh ``/proc`` and, on top, read-only binds of the
  interpreter's prefixes and the system libraries at their host paths (wherever they are, ``/tmp``
  included); ``pivot_root`` into it and detach the host tree; drop to an unprivileged uid (when root)
  so that no capability survives; set rlimits and a parent-death signal; exec. When the init dies,
  the kernel kills every process of the namespace, so nothing the code started survives it.
- ``rlimits``: the launcher becomes a child subreaper and runs the code as its child, as a dedicated
  unprivileged uid when root (so that RLIMIT_NPROC holds and host processes cannot be signalled),
  with rlimits, a fresh working directory and a cleared environment. When the code's process ends,
  or on SIGTERM from the supervisor, every descendant is killed — orphans re-parent to the launcher,
  so ``setsid`` does not hide them. See ``docs/tool_library.md`` for what this mode does not contain.

The launcher itself stays outside as the parent of the namespace's init (or of the code) and exits
with the code's status (``128 + signal`` when it was killed by a signal).
"""

import contextlib
import ctypes
import json
import os
import platform
import resource
import shutil
import signal
import sys
import time

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}

NS_UID = 1000  # the uid the code sees inside a user namespace (non-root callers)
SANDBOX_DIR = "/sandbox"
EXIT_SETUP_FAILED = 125

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None) -> None:
    def enc(s):
        return None if s is None else s.encode()

    _check(
        _libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
        f"mount {target}",
    )


def _bind_read_only(host_path: str, new_root: str) -> None:
    target = new_root + host_path
    if os.path.islink(host_path):  # e.g. /bin -> usr/bin on merged-/usr systems
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if not os.path.lexists(target):
            os.symlink(os.readlink(host_path), target)
        return
    if os.path.isdir(host_path):
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(host_path, target, None, MS_BIND | MS_REC)
    _mount(None, target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _pivot_into(new_root: str) -> None:
    os.chdir(new_root)
    number = SYS_PIVOT_ROOT.get(platform.machine())
    if number is None:  # unknown architecture: chroot (the dropped capabilities keep it closed)
        os.chroot(".")
    else:
        _check(_libc.syscall(number, b".", b"."), "pivot_root")
        _check(_libc.umount2(b".", MNT_DETACH), "detach the host root")
    os.chdir("/")


def _build_root(cfg: dict) -> None:
    """The sandbox's own mounts first, then the read-only binds on top of them.

    In this order a bind may land anywhere — under ``/tmp`` (a virtualenv in a temporary directory)
    or ``/dev`` — because its mount point is created inside whatever is already mounted there.
    """
    new_root, scratch = cfg["new_root"], cfg["scratch"]
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    # One tmpfs behind both /sandbox and /tmp, so that workdir_bytes bounds what the code can write.
    # It is mounted outside the new root and vanishes from view with the host tree after pivot_root.
    _mount("tmpfs", scratch, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['workdir_bytes']},mode=755")
    work, tmp = scratch + "/sandbox", scratch + "/tmp"
    os.mkdir(work)
    os.mkdir(tmp)
    os.chmod(tmp, 0o1777)  # sticky: the code cannot rename the mount points created in it below
    for name in os.listdir(cfg["input_dir"]):
        shutil.copyfile(os.path.join(cfg["input_dir"], name), os.path.join(work, name))
    _chown_tree(work, cfg["uid"])
    for source, target in ((work, SANDBOX_DIR), (tmp, "/tmp")):
        os.mkdir(new_root + target)
        _mount(source, new_root + target, None, MS_BIND)
    os.mkdir(new_root + "/dev")
    for name in ("null", "zero", "random", "urandom"):
        open(f"{new_root}/dev/{name}", "a").close()
        _mount(f"/dev/{name}", f"{new_root}/dev/{name}", None, MS_BIND)
    os.mkdir(new_root + "/proc")
    # A fresh /proc shows only this PID namespace; some containers forbid mounting it.
    with contextlib.suppress(OSError):
        _mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for path in cfg["read_only"]:
        if os.path.lexists(path):
            _bind_read_only(path, new_root)
    _mount(None, new_root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    _pivot_into(new_root)


def _chown_tree(directory: str, uid) -> None:
    if uid is not None:
        for name in [".", *os.listdir(directory)]:
            os.chown(os.path.join(directory, name), uid, uid)


def _drop_to(uid) -> None:
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)


def _set_rlimits(limits: dict) -> None:
    for name, (soft, hard) in limits.items():
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _exec_code(cfg: dict, workdir: str) -> None:
    os.chdir(workdir)
    env = dict(cfg["env"], HOME=workdir, TMPDIR=workdir)
    os.execve(cfg["argv"][0], cfg["argv"], env)


def _namespace_init(cfg: dict) -> None:
    """PID 1 of the namespace: build the root, drop privileges, run the code as its only child.

    The code is not PID 1 itself because the kernel shields a namespace's init from signals it has
    no handler for — including the SIGXCPU/SIGKILL of RLIMIT_CPU.
    """
    stdin_fd = os.open(cfg["stdin_path"], os.O_RDONLY)
    _build_root(cfg)
    os.dup2(stdin_fd, 0)
    os.close(stdin_fd)
    _drop_to(cfg["uid"])
    # After the uid change (which clears it): die with the launcher, so that killing the launcher's
    # process group from outside always takes the whole namespace down. Until here this process is
    # still in the launcher's process group, so an earlier kill reaches it directly.
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    code_pid = os.fork()
    if code_pid == 0:
        _set_rlimits(cfg["rlimits"])
        _exec_code(cfg, SANDBOX_DIR)
    while True:  # reap orphans until the code's process ends; the namespace dies with this one
        pid, status = os.waitpid(-1, 0)
        if pid == code_pid:
            _exit_like(status)


def _exit_like(status: int) -> None:
    if os.WIFSIGNALED(status):
        os._exit(128 + os.WTERMSIG(status))
    os._exit(os.WEXITSTATUS(status))


class _Stop(Exception):
    """SIGTERM from the supervisor (time or output limit reached): kill everything and exit."""


def _stop(signum, frame) -> None:
    raise _Stop


def _run_in_namespaces(cfg: dict) -> None:
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    euid, egid = os.geteuid(), os.getegid()
    if euid != 0:
        flags |= CLONE_NEWUSER
    _check(_libc.unshare(flags), "unshare")
    if euid != 0:
        # Map an unprivileged uid (not 0): execve then drops every capability of the namespace.
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{NS_UID} {euid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{NS_UID} {egid} 1")
    child = os.fork()
    if child == 0:
        try:
            _namespace_init(cfg)
        except BaseException as exc:
            os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(EXIT_SETUP_FAILED)
    signal.signal(signal.SIGTERM, _stop)
    try:
        _, status = os.waitpid(child, 0)
    except _Stop:
        # Kill the init and wait for it: the kernel reaps every other process of the namespace
        # before its init is reaped, so when this returns nothing the code started is left.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        os.kill(child, signal.SIGKILL)
        _, status = os.waitpid(child, 0)
    _exit_like(status)


def _run_with_rlimits(cfg: dict) -> None:
    _check(_libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)")
    signal.signal(signal.SIGTERM, _stop)
    stdin_fd = os.open(cfg["stdin_path"], os.O_RDONLY)
    _chown_tree(cfg["input_dir"], cfg["uid"])
    code_pid = os.fork()
    if code_pid == 0:
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.dup2(stdin_fd, 0)
            os.close(stdin_fd)
            os.chdir(cfg["input_dir"])
            _drop_to(cfg["uid"])
            _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
            _set_rlimits(cfg["rlimits"])
            _exec_code(cfg, cfg["input_dir"])
        except BaseException as exc:
            os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(EXIT_SETUP_FAILED)
    os.close(stdin_fd)
    status = None
    try:
        while status is None:  # reap orphans (we are their subreaper) until the code's process ends
            pid, wait_status = os.waitpid(-1, 0)
            if pid == code_pid:
                status = wait_status
    except _Stop:
        status = signal.SIGKILL  # a wait status meaning "killed by SIGKILL"
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _kill_descendants()
    _exit_like(status)


def _children_of(parent: int) -> list[int]:
    """Live (non-zombie) processes whose parent is ``parent``, from /proc."""
    children = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != b"Z":
            children.append(int(entry))
    return children


def _kill_descendants() -> None:
    """SIGKILL every descendant until none is left, reaping the ones that re-parent to us.

    A process killed here cannot fork any more, and its orphans re-parent to this subreaper, so each
    round leaves only processes forked since the last one; the loop ends when a round finds none.
    """
    me = os.getpid()
    while True:
        tree, frontier = [], [me]
        while frontier:
            children = [child for parent in frontier for child in _children_of(parent)]
            tree += children
            frontier = children
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        time.sleep(0.001)  # let the killed ones die and their orphans re-parent to us


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    try:
        if cfg["mode"] == "namespaces":
            _run_in_namespaces(cfg)
        else:
            _run_with_rlimits(cfg)
    except OSError as exc:
        os.write(2, f"sandbox setup failed: {exc}\n".encode())
        os._exit(EXIT_SETUP_FAILED)


if __name__ == "__main__":
    main()
