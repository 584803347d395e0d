"""Checkpoints mirrored to an artifact store at a URL, so a stage killed on one machine resumes on another.

A stage run against a store at a URL (flows/store/url.py) runs in a local cache folder and writes
`STORE_FILE` there, naming the stage's folder in the store. `checkpoint.save` then calls `upload`: every
checkpoint it writes goes to the same relative path in the store (`<url>/<stage>/<digest>/checkpoints/
step-00000020/`, beside where `out/` is published), its files first and its marker (COMPLETE.json, with
each file's size and sha256) last, so a checkpoint in the store counts once its marker is there; then the
store's steps older than the oldest the local rotation kept are deleted, so the store holds what the
machine holds (the newest two: an rl critic's newest may be a step ahead of its policy's, and resumes
at the policy's). A stage that starts on a machine whose cache has no checkpoint as new as the store's
newest downloads it with `fetch_newest` (under a temporary name, renamed into place), and the engine
resumes from it as from its own, after checking every file against the marker.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path

from alignflow.core.train.checkpoint_dirs import MARKER, step_dirs

log = logging.getLogger(__name__)

STORE_FILE = ".checkpoint-store.json"  # in a stage's cache folder: {"url": its folder in the store, "folders": bool}
_STEP = re.compile(r"step-(\d+)")


def store_of(root: Path) -> tuple[object, str, bool] | None:
    """(fsspec filesystem, the path in it that mirrors checkpoint folder `root`, whether it has folders),
    from the `STORE_FILE` of the nearest folder above `root`; None on a local store."""
    root = Path(root).resolve()
    for folder in root.parents:
        path = folder / STORE_FILE
        if path.is_file():
            from fsspec.core import url_to_fs

            found = json.loads(path.read_text())
            fs, base = url_to_fs(found["url"])
            return fs, "/".join([base.rstrip("/"), *root.relative_to(folder).parts]), bool(found["folders"])
    return None


def upload(root: Path, final: Path) -> None:
    """Copy checkpoint `final` (a `step-N` folder of `root`) to the store, marker last, then delete the
    store's steps older than what `root` kept. A failed upload is a warning: the stage goes on, and a
    resume elsewhere starts from the store's previous checkpoint."""
    found = store_of(root)
    if found is None:
        return
    fs, remote, folders = found
    target = f"{remote}/{final.name}"
    try:
        with contextlib.suppress(FileNotFoundError):  # a copy left by an earlier run: not complete until re-marked
            fs.rm_file(f"{target}/{MARKER}")
        files = sorted(p for p in final.rglob("*") if p.is_file() and p.name != MARKER) + [final / MARKER]
        for path in files:
            rpath = f"{target}/{path.relative_to(final).as_posix()}"
            if folders:
                fs.makedirs(rpath.rsplit("/", 1)[0], exist_ok=True)
            fs.put_file(str(path), rpath)
        oldest = min(step for step, _ in step_dirs(root))
        for step, rpath in remote_steps(fs, remote):
            if step < oldest:  # older than any kept here (never a newer one another run wrote)
                fs.rm(rpath, recursive=True)
    except Exception as exc:  # the network: the next checkpoint tries again
        log.warning("checkpoint %s: could not upload it to %s: %s: %s", final, fs.unstrip_protocol(target),
                    type(exc).__name__, exc)
        return
    log.info("checkpoint %s uploaded to %s", final.name, fs.unstrip_protocol(target))


def remote_steps(fs, remote: str) -> list[tuple[int, str]]:
    """(step, path) of the step folders directly under `remote` in the store, oldest first."""
    fs.invalidate_cache(remote)  # s3fs and gcsfs cache listings
    try:
        names = fs.ls(remote, detail=False)
    except FileNotFoundError:
        return []
    found = [(int(m.group(1)), name.rstrip("/")) for name in names
             if (m := _STEP.fullmatch(name.rstrip("/").rsplit("/", 1)[-1]))]
    return sorted(found)


def _marked(fs, remote: str) -> dict[tuple[str, ...], dict[int, list[str]]]:
    """{checkpoint folder (relative parts): {step: its files}} of the store's complete checkpoints."""
    fs.invalidate_cache(remote)
    try:
        paths = fs.find(remote, detail=False)
    except FileNotFoundError:
        return {}
    files: dict[tuple[tuple[str, ...], int], list[str]] = {}
    for path in paths:
        parts = path[len(remote.rstrip("/")) + 1:].split("/")
        at = next((i for i, part in enumerate(parts) if _STEP.fullmatch(part)), None)
        if at is not None:
            files.setdefault((tuple(parts[:at]), int(parts[at][5:])), []).append(path)
    roots: dict[tuple[str, ...], dict[int, list[str]]] = {}
    for (root, step), paths in files.items():
        if any(p.rsplit("/", 1)[-1] == MARKER for p in paths):
            roots.setdefault(root, {})[step] = paths
    return roots


def _local_newest(root: Path) -> int:
    return max((step for step, path in step_dirs(root) if (path / MARKER).is_file()), default=-1)


def fetch_newest(fs, remote: str, local: Path) -> int | None:
    """Download the store's newest checkpoint under `remote` into checkpoint folder `local` when this
    machine has none as new; returns its step, or None when nothing was fetched. Nested checkpoint
    folders (an rl critic's `critic/checkpoints/`) get their newest step at or below that one."""
    roots = _marked(fs, remote)
    top = max(roots.get((), {}), default=-1)
    if top <= _local_newest(local):
        return None
    for root, steps in sorted(roots.items()):
        usable = [s for s in steps if s <= top]
        if not usable:
            continue
        step = max(usable)
        folder = local.joinpath(*root)
        if _local_newest(folder) >= step:
            continue
        _download(fs, f"{remote}/{'/'.join([*root, f'step-{step:08d}'])}", steps[step], folder / f"step-{step:08d}")
    log.info("checkpoint step %d fetched from %s", top, fs.unstrip_protocol(remote))
    return top


def _download(fs, source: str, files: list[str], final: Path) -> None:
    """The files of one checkpoint into `final`, through `.tmp-<name>` (which `checkpoint.save` clears)."""
    tmp = final.with_name(f".tmp-{final.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    for rpath in sorted(files, key=lambda p: p.rsplit("/", 1)[-1] == MARKER):  # the marker last
        path = tmp / rpath[len(source) + 1:]
        path.parent.mkdir(parents=True, exist_ok=True)
        fs.get_file(rpath, str(path))
    if final.exists():  # an incomplete copy of the same step
        shutil.rmtree(final)
    os.replace(tmp, final)
