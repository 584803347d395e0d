"""A stage lock on an object store: numbered lock files created only-if-absent, held by a renewed lease.

The lock of one artifact is the folder `<stage>/<digest>.lock/`. Its holder is the owner of the
highest-numbered file in it, each file made with fsspec's `open(path, "xb")` (an exclusive create:
O_EXCL on a filesystem, `If-None-Match: *` on S3, `ifGenerationMatch=0` on GCS, `If-None-Match: *`
on Azure), so of two runs that try the same number exactly one succeeds. The file holds an owner id
and an expiry a heartbeat thread pushes `lease_s` ahead every `lease_s / 3`. A run that finds the
top file expired (its owner died) takes the lock by creating the next number: breaking never deletes
or overwrites a file another run may still hold, so two breakers cannot both win. The winner deletes
the numbers below its own; the holder deletes its file on release.

An owner that stalls past its lease (and so may have been broken) finds a higher number, or its file
gone or rewritten, at its next heartbeat or `check()`, and must not publish. Expiries are wall-clock
times: the machines' clocks must agree to well within a lease (NTP keeps them within milliseconds).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
import uuid

from alignflow.core.errors import AlignflowError

log = logging.getLogger(__name__)

LEASE_S = 120.0  # a dead run's lock is taken this long after its last heartbeat
# One process-wide lock around every exclusive create: memory:// checks-then-creates, which is
# atomic only if no other thread of the process creates at the same time.
_create_lock = threading.Lock()
_held: set["LeaseLock"] = set()  # this process's held locks, released by `release_held` on SIGINT/SIGTERM


class LockLost(AlignflowError):
    """This run's lease expired and another run took the lock: it must not publish."""


class LeaseLock:
    """An exclusive lock in `folder` of the fsspec filesystem `fs`; `name` says which, in messages."""

    def __init__(self, fs, folder: str, name: str, lease_s: float = LEASE_S, poll_s: float | None = None):
        self.fs, self.folder, self.name, self.lease_s = fs, folder.rstrip("/"), name, float(lease_s)
        self.poll_s = poll_s if poll_s is not None else min(2.0, self.lease_s / 4)
        self.owner = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:12]}"
        self.generation: int | None = None
        self.lost: str | None = None  # why the lock was lost, once it was
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    def __enter__(self) -> LeaseLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def path(self, generation: int) -> str:
        return f"{self.folder}/{generation:010d}"

    def acquire(self) -> None:
        """Wait while a live lease holds the lock; then create the next number, retrying when another run won it."""
        unreadable: dict[int, float] = {}  # number -> when first seen unreadable (being written, or its writer died)
        waiting_for = None
        while True:
            numbers = self._numbers()
            following = 0
            if numbers:
                top = numbers[-1]
                holder = self._read(top)
                if holder == "gone":  # released between the listing and the read
                    continue
                if holder is None:
                    first = unreadable.setdefault(top, time.monotonic())
                    expired, who = time.monotonic() - first > self.lease_s, "an unreadable lock file"
                else:
                    expired, who = float(holder.get("expires", 0)) < time.time(), holder.get("owner", "?")
                if not expired:
                    if waiting_for != (top, who):
                        log.info("%s: waiting for the lock held by %s", self.name, who)
                        waiting_for = (top, who)
                    time.sleep(self.poll_s)
                    continue
                log.warning("%s: the lease of %s expired: taking the lock", self.name, who)
                following = top + 1
            if self._create(following):
                if max(self._numbers(), default=-1) == following:
                    break
                # a higher number appeared while this run stalled between listing and creating: not ours
                self._remove(following)
        self.generation, self.lost = following, None
        for lower in numbers:  # expired: their owners are gone, or will find they lost the lock
            if lower < following:
                self._remove(lower)
        self._stop.clear()
        self._heartbeat = threading.Thread(target=self._renew, name=f"lease {self.name}", daemon=True)
        self._heartbeat.start()
        _held.add(self)

    def check(self) -> None:
        """Raise LockLost unless this run still holds the lock (call before publishing)."""
        if self.generation is None:
            raise LockLost(f"{self.name}: the lock is not held")
        reason = self.lost or self._lost_because()
        if reason:
            self.lost = reason
            raise LockLost(f"{self.name}: this run lost the lock ({reason}); another run owns the stage now. "
                           f"Was this process stalled for over {self.lease_s:.0f} s?")

    def release(self) -> None:
        """Stop the heartbeat and delete this run's lock file, unless another run has taken it meanwhile."""
        _held.discard(self)
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
        if self.generation is not None:
            held = self._read(self.generation)
            if isinstance(held, dict) and held.get("owner") == self.owner:
                self._remove(self.generation)
            self.generation = None

    def _renew(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            try:
                reason = self._lost_because()
                if reason:
                    self.lost = reason
                    log.error("%s: lost the lock: %s", self.name, reason)
                    return
                self.fs.pipe_file(self.path(self.generation), self._body())
            except Exception as exc:  # a network error: retried at the next beat, well inside the lease
                log.warning("%s: could not renew the lease: %s: %s", self.name, type(exc).__name__, exc)

    def _lost_because(self) -> str | None:
        numbers = self._numbers()
        if numbers and numbers[-1] > self.generation:
            return f"a newer lock file {self.path(numbers[-1])} exists"
        held = self._read(self.generation)
        if held == "gone":
            return f"its lock file {self.path(self.generation)} was deleted"
        if isinstance(held, dict) and held.get("owner") != self.owner:
            return f"its lock file {self.path(self.generation)} now names {held.get('owner')}"
        return None

    def _body(self) -> bytes:
        # never empty: s3fs writes an empty file with a plain (not exclusive) touch
        host, pid, _ = self.owner.split(":")
        return json.dumps({"owner": self.owner, "host": host, "pid": int(pid), "lease_s": self.lease_s,
                           "expires": time.time() + self.lease_s}).encode()

    def _create(self, number: int) -> bool:
        """Create lock file `number` only if absent; False when another run created it first."""
        for attempt in range(2):
            try:
                with _create_lock, self.fs.open(self.path(number), "xb") as f:
                    f.write(self._body())
                return True
            except FileExistsError:
                return False
            except FileNotFoundError:  # a filesystem without the folder yet; object stores have no folders
                if attempt:
                    raise
                self.fs.makedirs(self.folder, exist_ok=True)
        return False

    def _numbers(self) -> list[int]:
        self.fs.invalidate_cache(self.folder)  # s3fs and gcsfs cache listings
        try:
            names = self.fs.ls(self.folder, detail=False)
        except FileNotFoundError:
            return []
        return sorted(int(n) for n in (name.rstrip("/").rsplit("/", 1)[-1] for name in names) if n.isdigit())

    def _read(self, number: int) -> dict | str | None:
        """The lock file's content; "gone" when it does not exist; None while it cannot be parsed."""
        try:
            return json.loads(self.fs.cat_file(self.path(number)))
        except FileNotFoundError:
            return "gone"
        except ValueError:
            return None

    def _remove(self, number: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(self.path(number))


def release_held() -> None:
    """Release every lock this process holds (its run is being stopped: see flows/launch/shutdown.py)."""
    for held in list(_held):
        try:
            held.release()
        except Exception as exc:  # the store unreachable: the lease lapses by itself
            log.warning("%s: could not release the lock: %s", held.name, exc)
