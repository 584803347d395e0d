"""Run untrusted Python in a sandbox, with a private message channel to the process that started it.

Isolation `namespaces` (the default where bubblewrap's `bwrap` works): each run gets fresh mount, pid,
ipc, uts and network namespaces; a read-only view of only the interpreter, its stdlib, its
site-packages and the system's shared libraries; its own `/proc`, where no ancestor is in sight (the
bootstrap is the namespace's init, its command line blanked, its source read from a pipe); a
size-capped tmpfs as its working folder and `/tmp`, another as `/dev/shm`; no_new_privs; a seccomp
filter refusing new user namespaces (in one of its own, a process could mount a tmpfs without the
size cap). When the parent is root the program runs as a fresh, otherwise unused uid (bwrap runs
privileged and the bootstrap drops to it before the program starts); otherwise bwrap uses an
unprivileged user namespace and the program keeps the caller's uid. When a run ends, its pid
namespace takes every process it started and its mount namespace every file it wrote.

Isolation `basic` (where bwrap is missing or namespaces are not allowed): resource limits, a fresh uid
when root, a network namespace where the kernel allows one (else `socket` disabled in the child,
best-effort), a scratch folder on the host removed afterwards. It hides nothing else: the host's
world-readable files, and in `/proc` every host process with its command line (the scorer's, and its
own interpreter's path) stay visible; a fresh uid cannot signal or trace them, the caller's uid (a
non-root parent) can. `auto` warns when it has to fall back to this.

Both: rlimits (CPU, address space, file size, processes, open files), one memory cap for all the run's
processes where a cgroup can be made (core/sandbox/cgroup.py), an empty environment, one wall clock for
the whole run, clean-up included. The child's first message on the channel says that its
setup finished; it is sent before any untrusted code exists in the process, so a program cannot
forge a setup failure (exit status and output are its own and never read as the sandbox's verdict).
"""

from __future__ import annotations

import contextlib
import json
import logging
import marshal
import os
import random
import select
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from alignflow.core.sandbox.bwrap import SECCOMP, bwrap_args, pipe_of, probe
from alignflow.core.sandbox.cgroup import MemoryCgroup
from alignflow.core.errors import AlignflowError

log = logging.getLogger(__name__)

UID_BASE, UID_SPAN = 1 << 30, 1 << 28  # far above any account: a random pick collides with nothing
Isolation = Literal["auto", "namespaces", "basic"]
HEADER = struct.Struct(">I")

# The child's first code (a script, never imported): limits, privileges, network, the ready message,
# then the program with the channel as `send` / `recv`.
BOOTSTRAP = (Path(__file__).parent / "boot.py").read_text()


class SandboxError(AlignflowError):
    """The sandbox itself could not run (setup failed, no usable interpreter, leftover processes)."""


class SampleError(Exception):
    """The sandboxed program broke its side of the channel: it ran out of time, exited, or sent junk."""


class SampleTimeout(SampleError):
    """The run's wall clock ran out."""


@dataclass(frozen=True)
class Limits:
    """Per-run limits; `memory_bytes` caps each process's address space and, with a cgroup, the run's memory."""

    cpu_s: int = 5
    wall_s: float = 10.0  # the whole run: start, program, clean-up
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 32
    open_files: int = 64
    output_bytes: int = 64 << 10  # how much of the end of stdout/stderr comes back
    scratch_bytes: int = 64 << 20  # size of the tmpfs at the working folder and /tmp, and of /dev/shm's
    message_bytes: int = 8 << 20  # the largest message the program may send on the channel


@dataclass
class SandboxResult:
    returncode: int | None  # negative: killed by that signal (SIGXCPU, SIGKILL, SIGXFSZ ...)
    stdout: str  # the last `output_bytes` of each stream
    stderr: str
    timed_out: bool
    seconds: float
    uid: int | None  # the uid the run used; None when the parent was not root
    isolation: str = "namespaces"

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


_warned: set[str] = set()


@lru_cache(maxsize=None)
def namespaces_available(python: str) -> str | None:
    """None when bwrap can sandbox `python` here, else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap (`bwrap`) is not installed"
    try:
        with Sandbox("", Limits(wall_s=30.0), python, "namespaces"):
            pass
    except (SandboxError, SampleError, OSError) as exc:
        return str(exc)
    return None


def resolve_isolation(isolation: Isolation, python: str) -> str:
    """`namespaces` or `basic`: `auto` is namespaces where they work, else basic with a loud warning."""
    if isolation == "basic":
        return "basic"
    why = namespaces_available(python)
    if why is None:
        return "namespaces"
    if isolation == "namespaces":
        raise SandboxError(f"namespace isolation is not available: {why}")
    if why not in _warned:
        _warned.add(why)
        log.warning("SANDBOX FALLBACK: %s; untrusted code runs with rlimits and a fresh uid only: it can "
                    "read world-readable host files and /proc, and write to /tmp and /dev/shm. Install "
                    "bubblewrap (Debian: apt-get install bubblewrap) and allow user namespaces", why)
    return "basic"


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


def _tail(f, n: int) -> str:
    size = f.seek(0, os.SEEK_END)
    f.seek(max(0, size - n))
    return f.read().decode("utf-8", errors="replace")


class Sandbox:
    """One sandboxed interpreter running `program` (Python source; `send`/`recv` in its globals).

    `send(obj)` / `recv()` exchange messages of plain data with it: marshal to the child (safe to
    read only from a trusted writer), JSON back (parsed here by `json`, safe on any input). `recv`
    raises `SampleTimeout` when the run's wall clock (started at the spawn) runs out, `SampleError`
    when the program closed the channel or sent something malformed or too large. Closing kills
    everything the run started.
    """

    def __init__(self, program: str, limits: Limits | None = None, python: str | None = None,
                 isolation: Isolation = "auto"):
        self.limits = limits = limits or Limits()
        self.python = python = python or default_python()
        self.isolation = resolve_isolation(isolation, python) if isolation == "auto" else isolation
        root = os.geteuid() == 0
        self.uid = _pick_uid() if root else None
        self.workdir = None
        self.start = time.monotonic()
        self.deadline = self.start + limits.wall_s
        self._buffer = b""
        self.timed_out = False
        to_child, self._to_child = os.pipe()
        self._from_child, from_child = os.pipe()
        os.set_blocking(self._to_child, False)
        cfg = {"rlimits": _rlimits(limits), "uid": self.uid, "offline": self.isolation == "namespaces",
               "program": program, "path": probe(python)[2]}
        boot_fd = pipe_of(BOOTSTRAP.encode())  # from a pipe: its source is in no process's command line
        command = [python, "-I", "-S", f"/dev/fd/{boot_fd}", str(to_child), str(from_child)]
        keep = [to_child, from_child, boot_fd]
        if self.isolation == "namespaces":
            seccomp = []
            if SECCOMP is not None:
                keep.append(pipe_of(SECCOMP))
                seccomp = ["--seccomp", str(keep[-1])]
            command = bwrap_args(python, limits.scratch_bytes, privileged=root) + seccomp + ["--", *command]
            cwd = "/"
        else:
            self.workdir = cwd = tempfile.mkdtemp(prefix="alignflow-sandbox-")
            if self.uid is not None:
                os.chown(cwd, self.uid, self.uid)
        self._out, self._err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        self.cgroup = MemoryCgroup.create(limits.memory_bytes)  # None: the per-process rlimit only
        if self.cgroup is not None:
            command = self.cgroup.wrap(command)
        try:
            self.proc = subprocess.Popen(
                command, cwd=cwd, env={}, stdin=subprocess.DEVNULL, stdout=self._out, stderr=self._err,
                pass_fds=keep, start_new_session=True,
            )
        except BaseException:
            self._release()
            raise
        finally:
            for fd in keep:
                os.close(fd)
        self.result: SandboxResult | None = None
        try:
            self.send(cfg)
            ready = self.recv()
        except SampleError as exc:  # nothing untrusted has run yet: this is the sandbox's failure
            result = self.close()
            raise SandboxError(f"the sandbox could not be set up ({exc}; {self.isolation} isolation): "
                               f"{result.stderr.strip()[-500:]}") from None
        if ready != {"ready": True}:
            self.close()
            raise SandboxError(f"the sandbox sent {ready!r} before it was ready")

    def remaining(self) -> float:
        return self.deadline - time.monotonic()

    def send(self, obj: Any) -> None:
        data = marshal.dumps(obj)
        data = HEADER.pack(len(data)) + data
        while data:
            if self.remaining() <= 0:
                self.timed_out = True
                raise SampleTimeout("the wall clock ran out")
            if not _ready(self._to_child, select.POLLOUT, self.remaining()):
                continue
            try:
                data = data[os.write(self._to_child, data):]
            except BrokenPipeError:
                raise SampleError("the program stopped reading its channel") from None

    def _read(self, n: int) -> bytes:
        while len(self._buffer) < n:
            wait = self.remaining()
            if wait <= 0 or not _ready(self._from_child, select.POLLIN, wait):
                self.timed_out = True
                raise SampleTimeout("the wall clock ran out")
            part = os.read(self._from_child, 1 << 20)
            if not part:
                raise SampleError("the program closed its channel")
            self._buffer += part
        out, self._buffer = self._buffer[:n], self._buffer[n:]
        return out

    def recv(self) -> Any:
        (n,) = HEADER.unpack(self._read(HEADER.size))
        if n > self.limits.message_bytes:
            raise SampleError(f"a {n}-byte message, over the {self.limits.message_bytes}-byte limit")
        try:
            return json.loads(self._read(n))
        except (ValueError, RecursionError) as exc:
            raise SampleError(f"a malformed message: {exc}") from None

    def close(self) -> SandboxResult:
        """Kill the run and everything it started; wait for that, within the run's wall clock."""
        if self.result is not None:
            return self.result
        if self.proc.poll() is None:
            self.timed_out |= self.remaining() <= 0
            with contextlib.suppress(ProcessLookupError, PermissionError):  # the group is already empty
                os.killpg(self.proc.pid, signal.SIGKILL)  # namespaces: bwrap's own death takes the pid namespace
        self.proc.wait()
        if self.uid is not None and self.isolation == "namespaces":
            for _ in range(500):  # the kernel is still tearing the pid namespace down: wait for it
                if not processes_of(self.uid):
                    break
                time.sleep(0.001)
        if self.uid is not None:
            _kill_uid(self.uid, self.python)  # basic: includes processes that left the group with setsid
        limit, code = self.limits.output_bytes, self.proc.returncode
        if self.isolation == "namespaces" and code is not None and code > 128:
            code = 128 - code  # bwrap exits 128 + n for a program killed by signal n
        self.result = SandboxResult(code, _tail(self._out, limit), _tail(self._err, limit),
                                    self.timed_out, time.monotonic() - self.start, self.uid, self.isolation)
        self._release()
        return self.result

    def _release(self) -> None:
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._to_child = self._from_child = -1
        self._out.close()
        self._err.close()
        if self.cgroup is not None:
            self.cgroup.remove()
        if self.workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _ready(fd: int, event: int, seconds: float) -> bool:
    """Whether `fd` is ready for `event` (or closed) within `seconds`; poll, since fds may exceed 1023."""
    poller = select.poll()
    poller.register(fd, event)
    return bool(poller.poll(max(0, int(seconds * 1000) + 1)))


RUN_SCRIPT = """
code = recv()["code"]
exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
"""


def run_python(code: str, limits: Limits | None = None, python: str | None = None,
               isolation: Isolation = "auto") -> SandboxResult:
    """Run `code` as `main.py` in the sandbox until it exits or the wall clock runs out."""
    with Sandbox(RUN_SCRIPT, limits, python, isolation) as box:
        box.send({"code": code})
        try:
            box.proc.wait(timeout=max(0.0, box.remaining()))
        except subprocess.TimeoutExpired:
            box.timed_out = True
        return box.close()
