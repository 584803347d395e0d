"""Stage artifacts on disk: `artifacts/<stage>/<digest>/` with `out/`, `checkpoints/`, `manifest.json`.

The manifest is written last and atomically, so its presence means the outputs are complete.
A lock file beside each artifact folder serialises concurrent runs of the same stage.
A URL root (`s3://bucket/prefix`, any fsspec protocol) is a `RemoteArtifactStore` (flows/store/url.py,
where `open_store` opens either).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

MANIFEST = "manifest.json"
CURVES = "curves.json"  # step metrics, kept so a cached stage can still be plotted


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

    @contextlib.contextmanager
    def lock(self, stage: str, digest: str) -> Iterator[None]:
        """Hold an exclusive lock on one artifact; a second run of the same stage waits here."""
        path = self.root / stage / f"{digest}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def manifest(self, stage: str, digest: str) -> dict | None:
        """The finished artifact's manifest, or None when the stage has not completed."""
        path = self.folder(stage, digest) / MANIFEST
        return json.loads(path.read_text()) if path.is_file() else None

    def outputs(self, manifest: dict, stage: str) -> dict[str, Path]:
        """Absolute output paths of a manifest (stored relative, so artifacts can move)."""
        folder = self.folder(stage, manifest["digest"])
        return {k: folder / v for k, v in manifest["outputs"].items()}

    def fetch(self, stage: str, digest: str) -> None:
        """Make a finished artifact's outputs readable at `outputs()`: they already are, in a local store."""

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
        manifest = {**manifest, "outputs": relative}
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
