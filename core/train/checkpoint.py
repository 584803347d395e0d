"""Atomic, verified checkpoints over DeepSpeed's save_checkpoint/load_checkpoint.

Layout: `<root>/step-00000020/{ds/…, rng-rank0.pt, …, COMPLETE.json}`. A checkpoint is written
under `<root>/.tmp-step-00000020`, its marker (size and sha256 of every file) is written last and
the folder is renamed into place, so a kill at any moment leaves either a complete checkpoint or
none. On resume a checkpoint whose marker is missing or whose files do not match it is skipped
with a warning and the previous good one is used; it is never loaded. A stage on an artifact store at
a URL also uploads each checkpoint there (core/train/checkpoint_store.py).

A save that cannot write (a full disk or quota, or any other OS error) removes its partial folder, so the space
is given back, leaves every earlier checkpoint as it was, and raises CheckpointError naming the folder, the
filesystem and the step a rerun resumes from; the stage fails (the pipeline's error adds the stage's name).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from alignflow.core.train.checkpoint_dirs import MARKER, step_dirs
from alignflow.core.train.checkpoint_store import upload
from alignflow.core.errors import AlignflowError
from alignflow.core.train.dist import rank_and_world

log = logging.getLogger(__name__)

TAG = "ds"  # DeepSpeed's sub-folder inside a checkpoint
KEEP = 2
# a write that found no room: the disk, the user's quota, the largest file the filesystem takes
NO_ROOM = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
# torch.save reports a failed write as a RuntimeError without an errno (its zip writer's "unexpected pos")
_TORCH_WRITE = re.compile(r"unexpected pos|file write failed|write\(\): fd \d+ failed|open file failed"
                          r"|Parent directory .* does not exist")
LOW_SPACE = 1 << 20  # bytes left free below which a failed write is taken for a full disk


class CheckpointError(AlignflowError):
    """A checkpoint could not be saved or loaded."""


def rng_state() -> dict:
    """Every random generator a training step draws from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _digest(path: Path) -> str:
    """sha256 of a file, after flushing it to disk so the marker never outlives its data."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
        os.fsync(f.fileno())
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_marker(folder: Path, step: int) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MARKER)
    entries = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _digest(p)} for p in files}
    with open(folder / MARKER, "w") as f:
        json.dump({"step": step, "files": entries}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def verify(folder: Path) -> str | None:
    """Why this checkpoint cannot be trusted, or None when every file matches its marker."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        return f"no {MARKER} (interrupted while saving)"
    except (OSError, ValueError) as e:
        return f"unreadable {MARKER}: {e}"
    for name, want in marker["files"].items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want["size"]:
            return f"{name} is {path.stat().st_size} bytes, expected {want['size']} (truncated?)"
        if _digest(path) != want["sha256"]:
            return f"{name} fails its checksum"
    return None


def _rank() -> int:
    return rank_and_world()[0]


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(ds, root: Path, step: int, data_state: dict | None, keep: int = KEEP) -> Path:
    """Write a checkpoint of DeepSpeed engine `ds` at `step` atomically; all ranks call it.

    A write that fails for want of space or with another OS error raises CheckpointError (see `_failed`);
    any other error (a lost peer, a bug) is raised as it is. Either way the partial folder is removed and
    the earlier checkpoints are kept. On several ranks the rank that fails raises and the launcher stops the
    others, which wait for it.
    """
    root = Path(root)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    try:
        if _rank() == 0:
            for stale in root.glob(".tmp-step-*"):  # left by a save that was killed: space this one may need
                shutil.rmtree(stale)
            tmp.mkdir(parents=True)
        _barrier()
        ds.save_checkpoint(str(tmp), tag=TAG, client_state={"step": step, "data": data_state}, save_latest=False)
        torch.save(rng_state(), tmp / f"rng-rank{_rank()}.pt")
        _barrier()
        if _rank() == 0:
            _write_marker(tmp, step)
            if final.exists():  # a corrupt copy left by an earlier, interrupted run
                shutil.rmtree(final)
            os.replace(tmp, final)
    except Exception as exc:
        try:
            error = _failed(exc, root, tmp, step)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if error is None:
            raise
        raise error from exc
    if _rank() == 0:
        _fsync_dir(root)
        for _, old in step_dirs(root)[:-keep]:
            shutil.rmtree(old)
        upload(root, final)  # to the stage's artifact store when it is at a URL: resumable on another machine
    _barrier()
    return final


def _write_error(exc: BaseException | None) -> BaseException | None:
    """The error in `exc`'s chain that says a file could not be written: an OSError (but a lost connection) or
    torch.save's RuntimeError for a failed write; None when there is none."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and not isinstance(exc, ConnectionError):
            return exc
        if isinstance(exc, RuntimeError) and _TORCH_WRITE.search(str(exc)):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def _mount_point(path: Path) -> Path:
    """The mount point of the filesystem that holds `path` (which may not exist yet)."""
    path = Path(os.path.abspath(path))
    while not path.exists():
        path = path.parent
    while not os.path.ismount(path):
        path = path.parent
    return path


def _free_bytes(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _size(folder: Path) -> int:
    """Bytes in the files under `folder`; those that vanish meanwhile (another rank's cleanup) count 0."""
    total = 0
    for path in folder.rglob("*"):
        with contextlib.suppress(OSError):
            total += path.stat().st_size if path.is_file() else 0
    return total


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _failed(exc: BaseException, root: Path, tmp: Path, step: int) -> CheckpointError | None:
    """The CheckpointError for a save of `step` into `tmp` that raised `exc`, measured before `tmp` is removed:
    what failed, where, and what to do; None when `exc` is not a failed write."""
    error = _write_error(exc)
    if error is None:
        return None
    disk = _mount_point(root)
    free, written = _free_bytes(disk), _size(tmp)
    no_room = (getattr(error, "errno", None) in NO_ROOM or any(os.strerror(e) in str(error) for e in NO_ROOM)
               or (free is not None and free < LOW_SPACE))
    complete = [s for s, p in step_dirs(root) if s != step and (p / MARKER).is_file()]
    resume = (f"the stage resumes from step {complete[-1]}" if complete
              else "the stage starts over (it has no earlier checkpoint)")
    what = f"could not write the checkpoint of step {step} to {tmp}"
    kept = "the partial checkpoint is removed and earlier ones are kept"
    if not no_room:
        return CheckpointError(f"{what}: {error}; {kept}. Fix that and rerun: {resume}")
    left = f"{_bytes(free)} free" if free is not None else "free space unknown"
    return CheckpointError(f"{what}: out of space ({_bytes(written)} written, {left}; {error}); {kept}. "
                           f"Free space on {disk} and rerun: {resume}")


def _find_local(root: Path, step: int | None) -> Path | None:
    candidates = [(s, p) for s, p in reversed(step_dirs(root)) if step is None or s == step]
    if step is not None and not candidates:
        raise CheckpointError(f"no checkpoint for step {step} under {root}")
    for s, path in candidates:
        reason = verify(path)
        if reason is None:
            return path
        if step is not None:
            raise CheckpointError(f"checkpoint {path} is not usable: {reason}")
        log.warning("skipping checkpoint %s: %s", path, reason)
    if candidates:
        log.warning("no usable checkpoint under %s; starting from scratch", root)
    return None


def find(root: Path, step: int | None = None) -> Path | None:
    """The newest valid checkpoint under `root` (or exactly `step`), agreed on by all ranks."""
    result: list = [None]
    if _rank() == 0:
        try:
            result[0] = _find_local(Path(root), step)
        except CheckpointError as e:
            result[0] = e
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(result, src=0)
    if isinstance(result[0], CheckpointError):
        raise result[0]
    return result[0]


def load(ds, path: Path) -> dict:
    """Restore engine `ds` and this rank's RNG from `path`; returns {"step", "data"}."""
    path = Path(path)
    saved = len(list(path.glob("rng-rank*.pt")))  # one per rank that saved it
    world = rank_and_world()[1]
    if saved != world:
        raise CheckpointError(f"{path} was saved by {saved} processes and this run has {world}: resume it on "
                              f"{saved} (alignflow run --nproc {saved}), or delete {path.parent} to start over")
    rng_file = path / f"rng-rank{_rank()}.pt"
    loaded, client = ds.load_checkpoint(str(path), tag=TAG)
    if loaded is None:
        raise CheckpointError(f"DeepSpeed could not load {path}")
    # our own file, written next to DeepSpeed's: it holds numpy's state tuple, not only tensors
    set_rng_state(torch.load(rng_file, weights_only=False))
    return {"step": client["step"], "data": client.get("data")}
