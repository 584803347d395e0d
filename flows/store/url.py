"""Stage artifacts under an fsspec URL (`s3://bucket/prefix`, `gs://`, `az://`, `file://`, `memory://`).

The store keeps the local layout, `<url>/<stage>/<digest>/` with `out/`, `curves.json` and
`manifest.json`. A stage runs in a local cache folder, `RunOptions.cache` ($ALIGNFLOW_CACHE, else
`~/.cache/alignflow`) then `artifacts/<protocol>/<path>/<stage>/<digest>/` (one per root: two roots
never share a `work/`): runners get local paths. Each checkpoint is uploaded as it is written, to
`checkpoints/` beside `out/` (core/train/checkpoint_store.py), and a stage that starts on a machine without a
checkpoint as new as the store's downloads the newest: a stage killed on one machine resumes on another. When
it finishes it publishes: `out/` and `curves.json` first, then the manifest, written to a temporary name and
moved into place, so a reader that finds the manifest finds every output; then the store's checkpoints are
deleted. A finished artifact a stage reads is downloaded once into the cache and reused; a copy changed here
after its download is downloaded again (`reusable` in flows/launch/execute.py). The stage lock is a
`LeaseLock` (flows/store/lease.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata as md
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Iterator

from alignflow.core.train import checkpoint_store
from alignflow.core.errors import AlignflowError, SpecError
from alignflow.flows.store.artifacts import (CURVES, MANIFEST, ArtifactStore, damaged, file_hashes,
                                            write_json_atomic)
from alignflow.flows.store.lease import LeaseLock
from alignflow.flows.options import LOCK_ENV, RunOptions

log = logging.getLogger(__name__)

FETCHED = ".fetched"  # in a cache folder: its out/ is a complete copy of the published one
# fsspec backends whose open(path, "xb") creates a file only if it is absent, atomically, with the first
# release that does it for files of any size. Any other backend cannot hold the stage lock.
EXCLUSIVE_CREATE = {
    "LocalFileSystem": None,  # open(..., "xb"): O_EXCL
    "MemoryFileSystem": None,  # one process; flows/store/lease.py serialises its check-then-create
    "S3FileSystem": ("s3fs", "2025.7.0"),  # If-None-Match: * (2024.12.0 sent it for multipart uploads only)
    "GCSFileSystem": ("gcsfs", "2024.12.0"),  # ifGenerationMatch=0
    "AzureBlobFileSystem": ("adlfs", "2024.12.0"),  # If-None-Match: *
}
OBJECT_STORES = ("MemoryFileSystem", "S3FileSystem", "GCSFileSystem", "AzureBlobFileSystem")  # no folders


def is_url(root: str | Path | None) -> bool:
    """A root with a protocol (`s3://...`, `file://...`); a `Path` never is one."""
    return isinstance(root, str) and "://" in root


def open_store(root: str | Path, options: RunOptions = RunOptions()) -> ArtifactStore:
    """The store at `root`: a local folder, or an fsspec URL (`s3://bucket/prefix`, `file://`, `memory://`)
    with its cache and locking from `options`."""
    return RemoteArtifactStore(root, options) if is_url(root) else ArtifactStore(Path(root))


def exclusive_create_problem(fs) -> str | None:
    """Why `fs` cannot create a file only if absent (so cannot hold the stage lock), or None when it can."""
    for cls in type(fs).__mro__:
        if cls.__name__ in EXCLUSIVE_CREATE:
            need = EXCLUSIVE_CREATE[cls.__name__]
            if need is None:
                return None
            dist, least = need
            try:
                have = md.version(dist)
            except md.PackageNotFoundError:
                return None  # a vendored copy: trust it
            if _version(have) >= _version(least):
                return None
            return f"{dist} {have} cannot create a file only if absent; {dist}>={least} can (pip install -U {dist})"
    return f"fsspec's {type(fs).__name__} cannot create a file only if absent (fsspec open(path, 'xb'))"


def _version(text: str) -> tuple:
    from packaging.version import Version

    return Version(text).release


class RemoteArtifactStore(ArtifactStore):
    """An fsspec URL root; `folder()`, `work_dir()` and `outputs()` are paths in the local cache."""

    def __init__(self, url: str, options: RunOptions = RunOptions(), lease_s: float | None = None):
        from fsspec.core import url_to_fs

        self.url = url.rstrip("/")
        try:
            self.fs, base = url_to_fs(self.url)
        except (ImportError, ValueError) as exc:  # "Install s3fs to access S3", an unknown protocol
            raise SpecError(f"artifacts root {url}: {exc}") from None
        self.base = base.rstrip("/")
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        cache = Path(options.cache) if options.cache else Path.home() / ".cache" / "alignflow"
        super().__init__(cache / "artifacts" / protocol / self.base.lstrip("/"))
        self.locking = options.artifact_lock
        if self.locking == "lease" and (problem := exclusive_create_problem(self.fs)):
            raise SpecError(f"artifacts root {url}: {problem}, which the stage lock needs. Use a local path, "
                            f"file://, s3://, gs:// or az://; or set {LOCK_ENV}=none when only one run at a "
                            "time can write to this store (stages run twice at once would publish twice)")
        self.lease_s = lease_s or options.lock_lease_s
        self.folders = not any(c.__name__ in OBJECT_STORES for c in type(self.fs).__mro__)
        self._held: dict[tuple[str, str], LeaseLock] = {}

    @property
    def location(self) -> str:
        return self.url

    def remote(self, stage: str, digest: str, *parts: str) -> str:
        return "/".join([self.base, stage, digest, *parts])

    @contextlib.contextmanager
    def lock(self, stage: str, digest: str) -> Iterator[None]:
        """The artifact's lease lock in the store: one run of a stage at a time, on any machine."""
        if self.locking == "none":
            yield
            return
        with LeaseLock(self.fs, f"{self.base}/{stage}/{digest}.lock", f"{stage}/{digest}", self.lease_s) as held:
            self._held[(stage, digest)] = held
            try:
                yield
            finally:
                self._held.pop((stage, digest), None)

    def manifest(self, stage: str, digest: str) -> dict | None:
        """The published manifest, or None; its manifest and curves are copied into the cache folder."""
        text = self._cat(self.remote(stage, digest, MANIFEST))
        if text is None:
            return None
        manifest = json.loads(text)
        folder = self.folder(stage, digest)
        folder.mkdir(parents=True, exist_ok=True)
        curves = self._cat(self.remote(stage, digest, CURVES))
        write_json_atomic(folder / CURVES, json.loads(curves) if curves is not None else {})
        write_json_atomic(folder / MANIFEST, manifest)
        return manifest

    def damaged(self, stage: str, digest: str, manifest: dict) -> str | None:
        """What is wrong with the downloaded copy here (changed since its download), or None when it is as
        published or not downloaded yet; `fetch(..., again=True)` mends a changed copy."""
        if not (self.folder(stage, digest) / FETCHED).is_file():
            return None
        return super().damaged(stage, digest, manifest)

    def published(self, manifest: dict, stage: str) -> dict[str, str]:
        """Output URLs in the store."""
        return {k: self.fs.unstrip_protocol(self.remote(stage, manifest["digest"], v))
                for k, v in manifest["outputs"].items()}

    def fetch(self, stage: str, digest: str, again: bool = False) -> None:
        """Download the published `out/` into the cache folder unless a complete copy is there (with `again`,
        even then: the copy here changed after its download). Raises when the store's own copy is not what
        was published."""
        folder = self.folder(stage, digest)
        if (folder / FETCHED).is_file() and not again:
            return
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder.parent / f"{digest}.fetch.lock", "a") as lock:  # one download per machine
            fcntl.flock(lock, fcntl.LOCK_EX)
            if again:
                (folder / FETCHED).unlink(missing_ok=True)
            elif (folder / FETCHED).is_file():
                return
            if self.manifest(stage, digest) is None:
                raise AlignflowError(f"stage {stage!r}: {self.url}/{stage}/{digest} has no manifest")
            partial = folder / f".out.{uuid.uuid4().hex[:8]}"
            try:
                source = self.remote(stage, digest, "out")
                for rpath in self.fs.find(source, detail=False):
                    local = partial / rpath[len(source) + 1:]
                    local.parent.mkdir(parents=True, exist_ok=True)
                    self.fs.get_file(rpath, str(local))
                partial.mkdir(exist_ok=True)  # an output folder may be empty
                shutil.rmtree(folder / "out", ignore_errors=True)
                os.replace(partial, folder / "out")
            finally:
                shutil.rmtree(partial, ignore_errors=True)
            problem = damaged(folder, json.loads((folder / MANIFEST).read_text()).get("files"))
            if problem is not None:  # the store's copy: rerunning here would not mend it
                shutil.rmtree(folder / "out", ignore_errors=True)
                raise AlignflowError(f"stage {stage!r}: the outputs downloaded from {self.url}/{stage}/{digest} are "
                                     f"not what was published: {problem}")
            (folder / FETCHED).touch()
            log.info("%s/%s: downloaded from %s", stage, digest, self.url)

    def fresh_work_dir(self, stage: str, digest: str) -> Path:
        """An empty `work/`, and the store's newest checkpoint when this cache has none as new (a stage
        killed on another machine resumes here); `checkpoint.save` uploads this stage's checkpoints."""
        work = super().fresh_work_dir(stage, digest)
        folder = self.folder(stage, digest)
        write_json_atomic(folder / checkpoint_store.STORE_FILE,
                          {"url": self.fs.unstrip_protocol(self.remote(stage, digest)), "folders": self.folders})
        step = checkpoint_store.fetch_newest(self.fs, self.remote(stage, digest, "checkpoints"),
                                             self.checkpoint_dir(stage, digest))
        if step is not None:
            log.info("%s/%s: resuming from step %d of the checkpoint in %s", stage, digest, step, self.url)
        return work

    def finalise(self, stage: str, digest: str, outputs: dict[str, Path], manifest: dict,
                 curves: dict[str, list]) -> dict:
        """Move `work/` to `out/` here, publish out/, curves and then the manifest; drop the checkpoints last."""
        folder = self.folder(stage, digest)
        relative = self.relative_outputs(stage, digest, outputs)
        shutil.rmtree(folder / "out", ignore_errors=True)
        os.replace(folder / "work", folder / "out")
        manifest = {**manifest, "outputs": relative, "files": file_hashes(folder)}
        write_json_atomic(folder / CURVES, curves)
        self.publish(stage, digest, manifest)
        # Only now: a failed upload leaves the checkpoints, and the rerun resumes from the last one.
        shutil.rmtree(folder / "checkpoints", ignore_errors=True)
        try:  # a finished stage is never resumed: the store's copies only cost space
            self.fs.rm(self.remote(stage, digest, "checkpoints"), recursive=True)
        except FileNotFoundError:
            pass
        except Exception as exc:
            log.warning("%s/%s: could not delete its checkpoints in %s: %s", stage, digest, self.url, exc)
        write_json_atomic(folder / MANIFEST, manifest)
        (folder / FETCHED).touch()
        return manifest

    def publish(self, stage: str, digest: str, manifest: dict) -> None:
        """Upload the cache folder's out/ and curves, then the manifest; only while holding the lock."""
        folder, held = self.folder(stage, digest), self._held.get((stage, digest))
        if self.locking == "lease":
            if held is None:
                raise AlignflowError(f"{stage}/{digest}: publishing needs the stage lock (store.lock)")
            held.check()
        out = self.remote(stage, digest, "out")
        with contextlib.suppress(FileNotFoundError):  # what an interrupted publish left
            self.fs.rm(out, recursive=True)
        for path in sorted(p for p in (folder / "out").rglob("*") if p.is_file()):
            self._put(path, f"{out}/{path.relative_to(folder / 'out').as_posix()}")
        self._put(folder / CURVES, self.remote(stage, digest, CURVES))
        if held is not None:
            held.check()  # a run whose lease lapsed during the upload leaves the manifest to the new holder
        target = self.remote(stage, digest, MANIFEST)
        partial = self.remote(stage, digest, f".{MANIFEST}.{uuid.uuid4().hex[:8]}.tmp")
        self.fs.pipe_file(partial, json.dumps(manifest, indent=2, sort_keys=True, default=str).encode())
        self.fs.mv(partial, target)  # a rename, or a server-side copy: never a half-written manifest

    def _put(self, local: Path, rpath: str) -> None:
        if self.folders:
            self.fs.makedirs(self.fs._parent(rpath), exist_ok=True)
        self.fs.put_file(str(local), rpath)

    def _cat(self, rpath: str) -> bytes | None:
        try:
            return self.fs.cat_file(rpath)
        except FileNotFoundError:
            return None
