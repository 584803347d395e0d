"""Run untrusted Python in a separate process: resource limits, no privileges, no network, a scratch folder.

Each run gets a fresh, otherwise unused uid when the parent is root, so RLIMIT_NPROC counts only that
run's processes, files not world-readable are out of reach, and every process the run leaves behind
(even one that called setsid) is found and killed by uid afterwards. Network: a new network namespace
(no interfaces) where the kernel allows one; otherwise `socket` is disabled in the child before user
code runs, which is best-effort only (ctypes can bypass it). Not covered: world-readable files, and
disk use through many files each under the file-size limit in world-writable folders.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from alignflow.core.errors import AlignflowError

UID_BASE, UID_SPAN = 1 << 30, 1 << 28  # far above any account: a random pick collides with nothing

# Runs in the child as root, before any user code: limits, network, privileges, then the program.
SETUP_FAILED = "alignflow-sandbox-setup-failed"
BOOTSTRAP = r"""
import ctypes, json, os, resource, sys
def setup(cfg):
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    libc = ctypes.CDLL(None, use_errno=True)
    CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
    offline = libc.unshare(CLONE_NEWNET) == 0  # needs CAP_SYS_ADMIN: root on most hosts
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
        if 0 in os.getresuid() or 0 in os.getresgid():
            raise PermissionError("still root after setuid")
    if not offline:  # an unprivileged user namespace owns its own network namespace
        offline = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    if not offline:
        import socket, _socket
        class _NoSocket(socket.socket):  # a class, so that modules subclassing socket still import
            def __init__(self, *args, **kwargs):
                raise PermissionError("network access is disabled in the sandbox")
        for mod in (socket, _socket):
            mod.socket = mod.SocketType = _NoSocket
try:
    setup(json.loads(sys.argv[1]))
except BaseException as exc:
    sys.stderr.write(f"alignflow-sandbox-setup-failed: {exc!r}\n")
    os._exit(125)
del setup
sys.argv = ["main.py"]
with open("main.py") as f:
    code = compile(f.read(), "main.py", "exec")
exec(code, {"__name__": "__main__", "__file__": "main.py", "__builtins__": __builtins__})
"""


class SandboxError(AlignflowError):
    """The sandbox itself could not run (no usable interpreter, leftover processes)."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits; memory is address space, so it bounds what one allocation may ask for."""

    cpu_s: int = 5
    wall_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 32
    open_files: int = 64
    output_bytes: int = 64 << 10  # how much of the end of stdout/stderr comes back


@dataclass
class SandboxResult:
    returncode: int  # negative: killed by that signal (SIGXCPU, SIGKILL, SIGXFSZ ...)
    stdout: str  # the last `output_bytes` of each stream
    stderr: str
    timed_out: bool
    seconds: float
    uid: int | None  # the uid the run used; None when the parent was not root

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out


def _world_reachable(path: Path) -> bool:
    """True if `path` and every folder above it can be entered and read by any user."""
    for p in [path, *path.parents]:
        mode = p.stat().st_mode
        if not mode & stat.S_IXOTH or (p == path and not mode & stat.S_IROTH):
            return False
    return True


@lru_cache(maxsize=1)
def default_python() -> str:
    """An interpreter the dropped user can run: this one when reachable, else the system's python3."""
    if os.geteuid() != 0:
        return sys.executable
    for exe in [sys.executable, "/usr/bin/python3", shutil.which("python3")]:
        if exe and os.path.exists(exe) and _world_reachable(Path(os.path.realpath(exe)).parent.parent):
            return exe
    raise SandboxError(
        "no Python interpreter is readable by an unprivileged user (the stdlib of "
        f"{sys.executable} is not world-readable); install python3 system-wide or pass `python=`"
    )


def _pick_uid() -> int:
    """A random uid from the reserved range, which must be mapped in this user namespace."""
    for line in Path("/proc/self/uid_map").read_text().splitlines():
        inside, _, count = map(int, line.split())
        if inside <= UID_BASE and UID_BASE + UID_SPAN <= inside + count:
            return random.SystemRandom().randrange(UID_BASE, UID_BASE + UID_SPAN)
    raise SandboxError(f"uids {UID_BASE}..{UID_BASE + UID_SPAN} are not mapped in this user namespace "
                       "(a rootless container?); run as a user other than root to sandbox without them")


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    return {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU at the soft limit, SIGKILL at the hard
        "RLIMIT_AS": (limits.memory_bytes, limits.memory_bytes),
        "RLIMIT_FSIZE": (limits.file_bytes, limits.file_bytes),
        "RLIMIT_NPROC": (limits.processes, limits.processes),
        "RLIMIT_NOFILE": (limits.open_files, limits.open_files),
        "RLIMIT_CORE": (0, 0),
    }


def processes_of(uid: int) -> list[int]:
    """Live (non-zombie) processes owned by `uid`."""
    pids = []
    for entry in os.scandir("/proc"):
        try:
            if entry.name.isdigit() and entry.stat().st_uid == uid:
                state = Path(f"/proc/{entry.name}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue  # exited while we looked
    return pids


def _kill_uid(uid: int, python: str) -> None:
    """SIGKILL every process of `uid`: kill(-1) as that uid is atomic with respect to new forks."""
    killer = [python, "-I", "-S", "-c", "import os; os.kill(-1, 9)"]  # spares only itself
    for _ in range(50):
        if not processes_of(uid):
            return
        subprocess.run(killer, user=uid, group=uid, extra_groups=[], env={}, cwd="/",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        time.sleep(0.01)
    raise SandboxError(f"sandbox processes of uid {uid} survived SIGKILL: {processes_of(uid)}")


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _tail(f, n: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - n))
    return f.read().decode("utf-8", errors="replace")


def run_python(code: str, limits: Limits | None = None, python: str | None = None) -> SandboxResult:
    """Run `code` as `main.py` in a fresh scratch folder under the limits; the folder is removed after."""
    limits = limits or Limits()
    python = python or default_python()
    uid = _pick_uid() if os.geteuid() == 0 else None
    workdir = Path(tempfile.mkdtemp(prefix="alignflow-sandbox-"))
    try:
        (workdir / "main.py").write_text(code)
        (workdir / "main.py").chmod(0o444)
        if uid is not None:
            os.chown(workdir, uid, uid)
        cfg = json.dumps({"rlimits": _rlimits(limits), "uid": uid})
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            start = time.monotonic()
            proc = subprocess.Popen(
                [python, "-I", "-c", BOOTSTRAP, cfg], cwd=workdir, env={}, stdin=subprocess.DEVNULL,
                stdout=out, stderr=err, start_new_session=True,
            )
            try:
                proc.wait(timeout=limits.wall_s)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            seconds = time.monotonic() - start
            _kill_group(proc.pid)
            proc.wait()
            if uid is not None:
                _kill_uid(uid, python)  # includes processes that left the group with setsid
            result = SandboxResult(proc.returncode, _tail(out, limits.output_bytes),
                                   _tail(err, limits.output_bytes), timed_out, seconds, uid)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if result.returncode == 125 and SETUP_FAILED in result.stderr:
        raise SandboxError(f"the sandbox could not be set up: {result.stderr.strip()[-500:]}")
    return result
