"""Stage artifacts on disk: `artifacts/<stage>/<digest>/` with `out/`, `checkpoints/`, `manifest.json`.

The manifest is written last and atomically, so its presence means the outputs are complete. It holds the
size and sha256 of every output file (`files`), and a cached stage's files are checked against them before
they are used again (`damaged`): a file changed, truncated or deleted after publishing is found, never
silently consumed. A file whose size and modification time are those of its last good check is not hashed
again (`.checked.json`, per machine), so the check costs a `stat` per file on an unchanged artifact.
A lock file beside each artifact folder serialises concurrent runs of the same stage.
A URL root (`s3://bucket/prefix`, any fsspec protocol) is a `RemoteArtifactStore` (flows/store/url.py,
where `open_store` opens either).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

MANIFEST = "manifest.json"
CURVES = "curves.json"  # step metrics, kept so a cached stage can still be plotted
CHECKED = ".checked.json"  # {file: [size, mtime_ns]} of the files whose hash last matched, on this machine



@contextlib.contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive flock on `path` (created, with its folder) for the block; other holders wait."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)

class ArtifactStore:
    """The artifacts root; one folder per (stage name, digest)."""

    def __init__(self, root: Path):
        self.root = Path(root)

    @property
    def location(self) -> str:
        """The root as another process on this or another machine opens it (`open_store`)."""
        return str(self.root)

    def folder(self, stage: str, digest: str) -> Path:
        return self.root / stage / digest

    def work_dir(self, stage: str, digest: str) -> Path:
        return self.folder(stage, digest) / "work"

    def checkpoint_dir(self, stage: str, digest: str) -> Path:
        return self.folder(stage, digest) / "checkpoints"

    def lock(self, stage: str, digest: str) -> contextlib.AbstractContextManager[None]:
        """Hold an exclusive lock on one artifact; a second run of the same stage waits here."""
        return exclusive_lock(self.root / stage / f"{digest}.lock")

    def manifest(self, stage: str, digest: str) -> dict | None:
        """The finished artifact's manifest, or None when the stage has not completed."""
        path = self.folder(stage, digest) / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

    def damaged(self, stage: str, digest: str, manifest: dict) -> str | None:
        """What is wrong with a finished artifact's files here (`folder: problem`), or None when they are as
        published. Manifests from before `files` existed are taken as they are."""
        return damaged(self.folder(stage, digest), manifest.get("files"))

    def outputs(self, manifest: dict, stage: str) -> dict[str, Path]:
        """Absolute output paths of a manifest (stored relative, so artifacts can move)."""
        folder = self.folder(stage, manifest["digest"])
        return {k: folder / v for k, v in manifest["outputs"].items()}

    def fetch(self, stage: str, digest: str, again: bool = False) -> None:
        """Make a finished artifact's outputs readable at `outputs()` (with `again`, download a copy that
        changed here once more): they already are, in a local store, which holds the only copy."""

    def published(self, manifest: dict, stage: str) -> dict[str, str]:
        """Output URIs, for records other machines read (the MLflow model registry)."""
        return {k: v.resolve().as_uri() for k, v in self.outputs(manifest, stage).items()}

    def fresh_work_dir(self, stage: str, digest: str) -> Path:
        """An empty `work/`: leftovers of an interrupted run are partial outputs, never reused."""
        work = self.work_dir(stage, digest)
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        self.checkpoint_dir(stage, digest).mkdir(exist_ok=True)
        return work

    def curves(self, stage: str, digest: str) -> dict[str, list[list[float]]]:
        """The step curves {metric: [[step, value], ...]} a finished stage logged."""
        path = self.folder(stage, digest) / CURVES
        return json.loads(path.read_text()) if path.is_file() else {}

    def finalise(self, stage: str, digest: str, outputs: dict[str, Path], manifest: dict,
                 curves: dict[str, list]) -> dict:
        """Move `work/` to `out/`, drop the checkpoints, then write the manifest; returns it."""
        folder = self.folder(stage, digest)
        work, out = folder / "work", folder / "out"
        relative = self.relative_outputs(stage, digest, outputs)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(work, out)
        # A finished stage is never resumed, and optimizer state is often larger than the model.
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        write_json_atomic(folder / CURVES, curves)
        manifest = {**manifest, "outputs": relative, "files": file_hashes(folder)}
        write_json_atomic(folder / MANIFEST, manifest)
        return manifest

    def relative_outputs(self, stage: str, digest: str, outputs: dict[str, Path]) -> dict[str, str]:
        """{key: "out/..."}: the runner's outputs under `work/` as they will be after the move."""
        work, relative = self.work_dir(stage, digest), {}
        for key, path in outputs.items():
            try:
                relative[key] = (Path("out") / Path(path).resolve().relative_to(work.resolve())).as_posix()
            except ValueError:
                raise ValueError(f"stage {stage!r} output {key!r}: {path} is not under {work}") from None
        return relative


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def file_hashes(folder: Path) -> dict[str, dict]:
    """{"out/...": {"size", "sha256"}} of every file under the artifact's `out/`; remembered as checked."""
    files, checked = {}, {}
    for path in sorted(p for p in (folder / "out").rglob("*") if p.is_file()):
        name, st = path.relative_to(folder).as_posix(), path.stat()
        files[name] = {"size": st.st_size, "sha256": _sha256(path)}
        checked[name] = [st.st_size, st.st_mtime_ns]
    write_json_atomic(folder / CHECKED, checked)
    return files


def damaged(folder: Path, files: dict[str, dict] | None) -> str | None:
    """The first file of `files` (file_hashes' record) that is missing, or differs in size or content, as
    `path: problem`; None when all are as recorded (or there is no record)."""
    if not files:
        return None
    try:
        checked = json.loads((folder / CHECKED).read_text())
    except (OSError, ValueError):
        checked = {}
    confirmed = {}
    for name, want in sorted(files.items()):
        path = folder / name
        try:
            st = path.stat()
        except FileNotFoundError:
            return f"{path}: missing (the manifest lists {want['size']} bytes)"
        if st.st_size != want["size"]:
            return f"{path}: {st.st_size} bytes, the manifest says {want['size']}"
        stamp = [st.st_size, st.st_mtime_ns]
        if checked.get(name) != stamp:  # changed since its last good check, or never checked here: hash it
            if _sha256(path) != want["sha256"]:
                return f"{path}: its content differs from what was published (sha256)"
            confirmed[name] = stamp
    if confirmed:
        with contextlib.suppress(OSError):  # a read-only store is checked again next time, no harm
            write_json_atomic(folder / CHECKED, {**checked, **confirmed})
    return None


def write_json_atomic(path: Path, obj: dict) -> None:
    """Write JSON to a temp file in the same folder, fsync, then rename over `path`."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
