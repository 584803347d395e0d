"""A memory cap on a sandboxed run as a whole: a cgroup of its own, so that every process the run starts
shares one limit (an rlimit caps each process alone: 32 processes under a 1 GiB setting could hold 32 GiB).

The run's first process joins the cgroup before it execs anything (`wrap`: a shell that writes its own pid
into `cgroup.procs`, then execs the command), so everything it forks is inside from its start. Past the
limit the kernel's OOM killer ends a process of the run, never one outside it. The cgroup is made under the
caller's own memory cgroup (cgroup v1's memory hierarchy, or v2 where the caller's cgroup delegates the
memory controller to its children), which needs write access there: root, or a delegated subtree. Where
that is missing, `MemoryCgroup.create` returns None and the run has the per-process rlimit only.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from functools import lru_cache
from pathlib import Path

log = logging.getLogger(__name__)
SHELL = "/bin/sh"


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount root, mount point, fs type, super options) of each mount, from /proc/self/mountinfo."""
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        out.append((fields[3], fields[4], fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""))
    return out


def _own_cgroups() -> dict[str, str]:
    """{controller list ("memory", "" for v2): this process's cgroup path}, from /proc/self/cgroup."""
    out = {}
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


@lru_cache(maxsize=1)
def memory_parent() -> tuple[Path, int] | None:
    """(this process's memory cgroup folder, cgroup version) where a child with a memory limit can be made
    in it; None where it cannot (no memory controller mounted, not delegated, or not writable)."""
    try:
        mounts, own = _mounts(), _own_cgroups()
    except (OSError, ValueError, IndexError):
        return None
    for root, point, fstype, options in mounts:
        if fstype == "cgroup" and "memory" in options.split(",") and "memory" in own:
            version, path = 1, own["memory"]
        elif fstype == "cgroup2" and "" in own:
            version, path = 2, own[""]
        else:
            continue
        relative = os.path.relpath(path, root)
        if relative.startswith(".."):
            continue  # our cgroup is outside this mount's view
        folder = Path(point) / relative
        if version == 2:
            try:
                if "memory" not in (folder / "cgroup.subtree_control").read_text().split():
                    continue  # our cgroup's children get no memory controller
            except OSError:
                continue
        if os.access(folder, os.W_OK):
            return folder, version
    return None


class MemoryCgroup:
    """A fresh cgroup under ours whose processes share `limit_bytes` of memory; `remove` when the run is over."""

    def __init__(self, folder: Path, version: int):
        self.folder, self.version = folder, version

    @classmethod
    def create(cls, limit_bytes: int) -> "MemoryCgroup | None":
        parent = memory_parent()
        if parent is None:
            return None
        folder = parent[0] / f"alignflow-sandbox-{uuid.uuid4().hex[:12]}"
        try:
            folder.mkdir()
        except OSError as exc:
            log.warning("code sandbox: could not make a memory cgroup in %s (%s): per-process limits only",
                        parent[0], exc)
            return None
        group = cls(folder, parent[1])
        try:
            if group.version == 1:
                (folder / "memory.limit_in_bytes").write_text(str(limit_bytes))
                swap = folder / "memory.memsw.limit_in_bytes"  # memory and swap together, where swap is counted
                if swap.exists():
                    swap.write_text(str(limit_bytes))
            else:
                (folder / "memory.max").write_text(str(limit_bytes))
                if (folder / "memory.swap.max").exists():
                    (folder / "memory.swap.max").write_text("0")
        except OSError as exc:
            group.remove()
            log.warning("code sandbox: could not set a memory cgroup's limit (%s): per-process limits only", exc)
            return None
        return group

    def wrap(self, command: list[str]) -> list[str]:
        """`command`, started by a shell that first moves itself into this cgroup."""
        return [SHELL, "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.folder), *command]

    def remove(self) -> None:
        """Remove the cgroup once its processes are gone (they were killed: the kernel may still be reaping)."""
        for _ in range(200):
            try:
                self.folder.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.005)
        log.warning("code sandbox: could not remove %s (processes still in it)", self.folder)
