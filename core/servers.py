"""Servers a stage starts as its children: on a free loopback port, waited for until they answer, and stopped
with everything they started (their process group) when the stage is done with them, fails or is interrupted.

The server runs in a session of its own, so a Ctrl-C meant for the run reaches it only through its parent's
cleanup (SIGTERM, then SIGKILL after a grace period); the run's signal handlers and watchdog find it among the
run's descendants like any other child.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

from alignflow.core.errors import AlignflowError

log = logging.getLogger(__name__)
STOP_GRACE_S = 5.0  # from SIGTERM to SIGKILL
POLL_S = 0.1  # between health checks while a server starts


class ServerError(AlignflowError):
    """A server did not start, or stopped answering."""


def free_port() -> int:
    """A loopback port no one listens on now, for a server or a process group's rendezvous to bind a moment later."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """`command` run as a server on a free loopback port (`{port}` in its arguments, and `$PORT`), ready once
    `GET http://127.0.0.1:PORT{health}` answers 200; stopped when the `with` block ends, and restartable."""

    def __init__(self, command: list[str], health: str, start_timeout_s: float, env: dict[str, str] | None = None,
                 cwd: str | None = None, what: str = "server"):
        self.command, self.health, self.start_timeout_s = command, health, start_timeout_s
        self.env, self.cwd, self.what = env or {}, cwd, what
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        """Start the server (stopping what is left of an earlier one) and wait until it answers."""
        self.stop()
        self.port = free_port()
        args = [a.replace("{port}", str(self.port)) for a in self.command]
        self.output = tempfile.TemporaryFile()  # a file, not a pipe: a chatty server never blocks on a full pipe
        try:
            self.proc = subprocess.Popen(args, env={**os.environ, **self.env, "PORT": str(self.port)}, cwd=self.cwd,
                                         stdin=subprocess.DEVNULL, stdout=self.output, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as exc:
            self.output.close()
            raise ServerError(f"{self.what}: cannot run {args!r} ({exc})") from exc
        started = time.monotonic()
        wait_healthy(self.proc, self.url + self.health, self.start_timeout_s, self.output, self.what)
        log.info("%s: %s answers on port %d (pid %d) after %.1f s", self.what, args[0], self.port, self.proc.pid,
                 time.monotonic() - started)

    def stop(self) -> None:
        if self.proc is not None:
            proc, self.proc = self.proc, None
            stop(proc)
            self.output.close()

    def __enter__(self) -> "ChildServer":
        try:
            self.start()
        except BaseException:
            self.stop()  # one that started but never answered
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_healthy(proc: subprocess.Popen, url: str, timeout_s: float, output, what: str) -> None:
    """Return once `url` answers 200; a ServerError (with the server's last output) if `proc` exits first or
    `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ServerError(f"{what}: {proc.args[0]} exited with {proc.returncode} before {url} answered; "
                              f"its output ends:\n{tail(output)}")
        try:
            with urllib.request.urlopen(url, timeout=max(POLL_S, min(1.0, deadline - time.monotonic()))) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass  # not listening yet
        if time.monotonic() >= deadline:
            raise ServerError(f"{what}: {url} did not answer within {timeout_s:g} s (start_timeout_s); the "
                              f"server's output ends:\n{tail(output)}")
        time.sleep(POLL_S)


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL what is left of it after the grace period; reap the server."""
    _signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE_S)
    _signal_group(proc.pid, signal.SIGKILL)  # a leader that ignored SIGTERM, or what it started and left behind
    proc.wait()


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group is empty
        os.killpg(pgid, sig)  # the group outlives its leader while any process it started lives


def tail(output, size: int = 2000) -> str:
    """The last `size` bytes a server wrote."""
    output.seek(0, os.SEEK_END)
    output.seek(max(0, output.tell() - size))
    return output.read().decode(errors="replace").strip() or "(nothing)"
