"""bubblewrap's side of the sandbox: the read-only view of an interpreter, the seccomp filter, the options.

`alignflow.core.sandbox.runner` runs `bwrap <bwrap_args(...)> -- python ...` for `namespaces` isolation.
"""

from __future__ import annotations

import json
import os
import platform
import struct
import subprocess
from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def probe(python: str) -> tuple[str, str, list[str]]:
    """sys.prefix, sys.base_prefix and sys.path (site's, for -I) of `python`."""
    probe = "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.path]))"
    out = subprocess.run([python, "-I", "-c", probe], capture_output=True, text=True, env={}, check=True)
    prefix, base_prefix, paths = json.loads(out.stdout)
    return prefix, base_prefix, paths


@lru_cache(maxsize=None)
def view(python: str) -> tuple[str, ...]:
    """bwrap arguments for a read-only view of what `python` needs: itself, its sys.path, shared libraries."""
    prefix, base_prefix, paths = probe(python)
    args: list[str] = []
    bound: list[str] = []
    made: set[str] = {"/"}

    def parents(path: str) -> None:  # bwrap would make them 0700, unreachable after the uid drop
        for folder in reversed(Path(path).parents):
            if str(folder) not in made:
                made.add(str(folder))
                args.extend(["--perms", "0755", "--dir", str(folder)])

    def bind(path: str) -> None:
        real = os.path.realpath(path)
        if os.path.exists(real) and not any(real == b or real.startswith(b + "/") for b in bound):
            bound.append(real)
            parents(real)
            args.extend(["--ro-bind", real, real])

    for top in ["/lib", "/lib32", "/lib64", "/libx32"]:  # the dynamic loader and libc
        if os.path.islink(top):
            args.extend(["--symlink", os.readlink(top), top])
        elif os.path.isdir(top):
            bind(top)
    for lib in ["/usr/lib", "/usr/lib32", "/usr/lib64"]:
        bind(lib)
    bind(python)
    if os.path.realpath(python) != python:  # the name it was started by: a venv finds pyvenv.cfg by it
        parents(python)
        args.extend(["--symlink", os.path.realpath(python), python])
    if prefix != base_prefix:
        bind(os.path.join(prefix, "pyvenv.cfg"))
    for path in paths:
        if path:
            bind(path)
    return tuple(args)


def _no_user_namespaces() -> bytes | None:
    """A seccomp filter (classic BPF) refusing new user namespaces: `unshare`/`clone` with CLONE_NEWUSER
    get EPERM, `clone3` ENOSYS (its flags sit behind a pointer; libc falls back to `clone`), and so do
    other ABIs (i386 via int 0x80, x32). Inside one, a process may mount an uncapped tmpfs of its own.
    None on an architecture this does not know."""
    arch, nr = {"x86_64": (0xC000003E, (435, 272, 56)), "aarch64": (0xC00000B7, (435, 97, 220))}.get(
        platform.machine(), (None, None))
    if arch is None:
        return None
    clone3, unshare, clone = nr
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, eperm, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38
    x32 = 0x40000000 if platform.machine() == "x86_64" else 0xFFFFFFFF
    program = [
        (ld, 0, 0, 4),  # 0: arch
        (jeq, 0, 8, arch),  # 1: else deny (10)
        (ld, 0, 0, 0),  # 2: syscall number
        (jge, 6, 0, x32),  # 3: x32 numbers: deny (10)
        (jeq, 6, 0, clone3),  # 4: -> ENOSYS (11)
        (jeq, 1, 0, unshare),  # 5: -> flags (7)
        (jeq, 0, 2, clone),  # 6: -> flags (7), else allow (9)
        (ld, 0, 0, 16),  # 7: the low half of args[0], the flags
        (jset, 1, 0, 0x10000000),  # 8: CLONE_NEWUSER -> deny (10), else allow (9)
        (ret, 0, 0, allow),  # 9
        (ret, 0, 0, eperm),  # 10
        (ret, 0, 0, enosys),  # 11
    ]
    return b"".join(struct.pack("<HBBI", *op) for op in program)


SECCOMP = _no_user_namespaces()


def bwrap_args(python: str, scratch_bytes: int, privileged: bool) -> list[str]:
    """bwrap's options for one run: the namespaces, the view, /proc, /dev, the capped tmpfs folders.

    `--as-pid-1`: the bootstrap is the pid namespace's init, so no ancestor (bwrap, with these options)
    is in the sandbox's /proc; it forks the program and reaps, as bwrap's own init would."""
    scratch = str(scratch_bytes)
    args = [
        "bwrap", "--unshare-pid", "--as-pid-1", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
        "--die-with-parent", "--new-session", *view(python), "--proc", "/proc", "--dev", "/dev",
        "--perms", "1777", "--size", scratch, "--tmpfs", "/tmp",
        "--perms", "1777", "--size", scratch, "--tmpfs", "/dev/shm", "--chdir", "/tmp",
    ]
    if privileged:  # the bootstrap drops to the run's uid; setuid clears these again
        args += ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        args += ["--unshare-user", "--disable-userns"]
    return args


def pipe_of(data: bytes) -> int:
    """The read end of a pipe holding `data` (under the pipe's 64 KiB buffer), its write end closed."""
    read_end, write_end = os.pipe()
    try:
        os.write(write_end, data)
    finally:
        os.close(write_end)
    return read_end
