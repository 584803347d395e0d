"""Atomic, verified checkpoints over DeepSpeed's save_checkpoint/load_checkpoint.

Layout: `<root>/step-00000020/{ds/…, rng-rank0.pt, …, COMPLETE.json}`. A checkpoint is written
under `<root>/.tmp-step-00000020`, its marker (size and sha256 of every file) is written last and
the folder is renamed into place, so a kill at any moment leaves either a complete checkpoint or
none. On resume a checkpoint whose marker is missing or whose files do not match it is skipped
with a warning and the previous good one is used; it is never loaded. A stage on an artifact store at
a URL also uploads each checkpoint there (core/train/checkpoint_store.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
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
    """Write a checkpoint of DeepSpeed engine `ds` at `step` atomically; all ranks call it."""
    root = Path(root)
    final, tmp = root / f"step-{step:08d}", root / f".tmp-step-{step:08d}"
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
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
        _fsync_dir(root)
        for _, old in step_dirs(root)[:-keep]:
            shutil.rmtree(old)
        for stale in root.glob(".tmp-step-*"):
            shutil.rmtree(stale)
        upload(root, final)  # to the stage's artifact store when it is at a URL: resumable on another machine
    _barrier()
    return final


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
