"""The artifact store at a URL (flows/store/url.py, flows/store/lease.py) on fsspec's `memory://` and on a
`file://` URL: publish with the manifest last, cached reuse from another machine's cache, one download of
an input, an interrupted publish, two processes racing for a stage, and a dead owner's expired lease.
Checkpoints on the store: tests/flows/test_checkpoint_store.py."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import threading
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractFileSystem

from alignflow.core.errors import AlignflowError, SpecError
from alignflow.flows.store import url as remote_store
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.store.lease import LeaseLock, LockLost, release_held
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.options import CACHE_ENV, LOCK_ENV, RunOptions
from alignflow.flows.store.url import RemoteArtifactStore, open_store
from reports import statuses
from store_race import finish_stage, hold_and_die, race

pytestmark = pytest.mark.system


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_local_path_keeps_the_local_store():
    assert type(open_store(Path("artifacts"))) is ArtifactStore
    # `--artifacts artifacts`: a folder, not a URL
    assert type(open_store("artifacts", RunOptions.from_env())) is ArtifactStore


def test_a_pipeline_publishes_to_the_url_and_another_machine_reuses_it(url, tmp_path, make_project, monkeypatch):
    project = make_project(tmp_path / "proj")
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-a"))
    first = run_pipeline(project / "chain.yaml", [], project, artifacts=url)
    assert statuses(first) == {"a": "ran", "b": "ran", "c": "ran", "d": "ran"}
    store = open_store(url, RunOptions.from_env())
    fs, base = store.fs, store.base
    for line in first.stages:  # every stage published: outputs, curves, and the manifest
        digest = Path(line.artifact).name
        assert fs.isfile(f"{base}/{line.name}/{digest}/manifest.json")
        assert fs.isfile(f"{base}/{line.name}/{digest}/curves.json")
        published = fs.cat_file(f"{base}/{line.name}/{digest}/out/data.jsonl")
        assert published == (Path(line.artifact) / "out" / "data.jsonl").read_bytes()
    assert len(rows(Path(first.stages[1].artifact) / "out" / "data.jsonl")) == 5  # b: subsample n=5 of a's 8
    assert not (project / "artifacts").exists()  # nothing went to the default local root

    # "Machine B", an empty cache, with a new c: a, b and d are cached; c's input b is downloaded, and only b.
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-b"))
    gets = []
    get_file = type(fs).get_file
    monkeypatch.setattr(type(fs), "get_file", lambda self, rpath, lpath, **kw: (gets.append(rpath),
                                                                                 get_file(self, rpath, lpath, **kw)))
    again = run_pipeline(project / "chain.yaml", ["c.selectors.0.config.in=[2]"], project, artifacts=url)
    assert statuses(again) == {"a": "cached", "b": "cached", "c": "ran", "d": "cached"}
    assert [s.metrics for s in again.stages if s.name != "c"] == [s.metrics for s in first.stages if s.name != "c"]
    c = next(s for s in again.stages if s.name == "c")
    assert {r["level"] for r in rows(Path(c.artifact) / "out" / "data.jsonl")} == {2}
    b_digest = Path(first.stages[1].artifact).name
    assert gets == [f"{base}/b/{b_digest}/out/data.jsonl"]
    cached = sorted(p.relative_to(tmp_path / "machine-b").parts[-3] for p in (tmp_path / "machine-b").rglob("out"))
    assert cached == ["b", "c"]  # a and d: their manifests only
    # a later stage reading b on this machine: no second download
    open_store(url, RunOptions.from_env()).fetch("b", b_digest)
    assert len(gets) == 1


def test_the_manifest_is_written_after_every_output(url, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    store = open_store(url, RunOptions.from_env())
    fs, seen = store.fs, []

    def check_then(method):
        def wrapped(self, *args, **kwargs):
            target = args[-1] if method != "pipe_file" else args[0]
            if target.endswith("/manifest.json"):  # the manifest lands: every output is there already
                assert fs.cat_file(f"{store.base}/s/d1/out/data.jsonl") == b"a\n"
                assert fs.cat_file(f"{store.base}/s/d1/out/model/w.bin") == b"xy"
                assert json.loads(fs.cat_file(f"{store.base}/s/d1/curves.json")) == {"loss": [[1, 0.5]]}
            seen.append((method, target.rsplit("/d1/", 1)[-1]))
            return original[method](self, *args, **kwargs)
        return wrapped

    original = {m: getattr(type(fs), m) for m in ("put_file", "pipe_file", "mv")}
    for m in original:
        monkeypatch.setattr(type(fs), m, check_then(m))
    with store.lock("s", "d1"):
        work = store.fresh_work_dir("s", "d1")
        (work / "data.jsonl").write_text("a\n")
        (work / "model").mkdir()
        (work / "model" / "w.bin").write_bytes(b"xy")
        manifest = store.finalise("s", "d1", {"dataset": work / "data.jsonl", "model": work / "model"},
                                  {"digest": "d1", "metrics": {}}, {"loss": [[1, 0.5]]})
    writes = [(m, t) for m, t in seen if ".lock/" not in t]  # the lease's own files aside
    assert writes[:3] == [("put_file", "out/data.jsonl"), ("put_file", "out/model/w.bin"),
                          ("put_file", "curves.json")]
    assert writes[-1] == ("mv", "manifest.json") and len(writes) == 5  # written under a temp name, then moved
    assert manifest["outputs"] == {"dataset": "out/data.jsonl", "model": "out/model"}
    assert store.published(manifest, "s")["model"] == fs.unstrip_protocol(f"{store.base}/s/d1/out/model")


def finished(store, digest="d1", content=b"0123456789"):
    """A finished stage `s` whose model folder holds one 10-byte weights file; its manifest."""
    with store.lock("s", digest):
        work = store.fresh_work_dir("s", digest)
        (work / "model").mkdir()
        (work / "model" / "w.bin").write_bytes(content)
        return store.finalise("s", digest, {"model": work / "model"}, {"digest": digest, "metrics": {}}, {})


def later(path: Path) -> None:
    """As if written a second after its last check (a clock tick can be coarser than two writes in a test)."""
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))


def test_an_output_changed_after_publishing_is_found_and_an_unchanged_one_is_not_hashed_again(tmp_path, monkeypatch):
    from alignflow.flows.store import artifacts

    store = ArtifactStore(tmp_path / "artifacts")
    manifest = finished(store)
    assert manifest["files"] == {"out/model/w.bin": {"size": 10, "sha256": hashlib.sha256(b"0123456789").hexdigest()}}
    hashed, sha256 = [], artifacts._sha256
    monkeypatch.setattr(artifacts, "_sha256", lambda path: hashed.append(path.name) or sha256(path))
    assert store.damaged("s", "d1", manifest) is None and hashed == []  # size and time as at its last check
    w = store.folder("s", "d1") / "out" / "model" / "w.bin"
    w.write_bytes(b"0123456780")  # the same size, another content
    later(w)
    assert store.damaged("s", "d1", manifest) == f"{w}: its content differs from what was published (sha256)"
    w.write_bytes(b"01234")
    assert store.damaged("s", "d1", manifest) == f"{w}: 5 bytes, the manifest says 10"
    w.unlink()
    assert store.damaged("s", "d1", manifest) == f"{w}: missing (the manifest lists 10 bytes)"
    w.write_bytes(b"0123456789")  # put back as published, at a new time: hashed once, then trusted
    later(w)
    hashed.clear()
    assert store.damaged("s", "d1", manifest) is None and store.damaged("s", "d1", manifest) is None
    assert hashed == ["w.bin"]
    assert store.damaged("s", "d1", {k: v for k, v in manifest.items() if k != "files"}) is None  # older manifests


def test_a_changed_download_is_fetched_again_and_a_changed_store_copy_is_an_error(url, tmp_path, monkeypatch):
    from alignflow.flows.launch.execute import reusable

    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-a"))
    manifest = finished(open_store(url, RunOptions.from_env()))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-b"))
    store = open_store(url, RunOptions.from_env())
    assert store.damaged("s", "d1", manifest) is None  # not downloaded yet: nothing here to be damaged
    store.fetch("s", "d1")
    local = store.folder("s", "d1") / "out" / "model" / "w.bin"
    local.write_bytes(b"01234")  # changed here
    problem = f"{local}: 5 bytes, the manifest says 10"
    assert store.damaged("s", "d1", manifest) == problem and local.read_bytes() == b"01234"  # the check only looks
    assert store.damaged("s", "d1", manifest) == problem
    assert reusable(store, "s", "d1", manifest) and local.read_bytes() == b"0123456789"  # downloaded again
    store.fs.pipe_file(f"{store.base}/s/d1/out/model/w.bin", b"0123456780")  # the store's own copy changed
    local.write_bytes(b"01234")
    with pytest.raises(AlignflowError, match=r"stage 's': the outputs downloaded from .* are not what was published: "
                                             r".*w\.bin: its content differs"):
        reusable(store, "s", "d1", manifest)


def test_a_local_artifact_changed_after_publishing_is_not_reused(tmp_path):
    from alignflow.flows.launch.execute import reusable

    store = ArtifactStore(tmp_path / "artifacts")
    manifest = finished(store)
    assert reusable(store, "s", "d1", manifest)
    (store.folder("s", "d1") / "out" / "model" / "w.bin").write_bytes(b"01234")
    assert not reusable(store, "s", "d1", manifest)  # its only copy: the stage runs again


def test_an_interrupted_publish_leaves_no_manifest_and_the_rerun_replaces_it(url, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    store = open_store(url, RunOptions.from_env())
    put = RemoteArtifactStore._put

    def fail_at_the_curves(self, local, rpath):
        if rpath.endswith("curves.json"):
            raise ConnectionError("network down")
        return put(self, local, rpath)

    monkeypatch.setattr(RemoteArtifactStore, "_put", fail_at_the_curves)
    with store.lock("s", "d1"):
        work = store.fresh_work_dir("s", "d1")
        (store.checkpoint_dir("s", "d1") / "step-3").mkdir()
        (work / "old.jsonl").write_text("stale\n")  # an output this attempt has and the next does not
        with pytest.raises(ConnectionError):
            store.finalise("s", "d1", {"dataset": work / "old.jsonl"}, {"digest": "d1", "metrics": {}}, {})
    assert store.manifest("s", "d1") is None
    assert store.fs.isfile(f"{store.base}/s/d1/out/old.jsonl")  # half published, invisible without the manifest
    assert (store.checkpoint_dir("s", "d1") / "step-3").is_dir()  # kept: the rerun resumes from them
    assert not store.fs.exists(f"{store.base}/s/d1.lock/0000000000")  # the lock was released

    monkeypatch.setattr(RemoteArtifactStore, "_put", put)
    with store.lock("s", "d1"):
        manifest = finish_stage(store, "s", "d1", "new\n")
    assert store.fs.find(f"{store.base}/s/d1/out") == [f"{store.base}/s/d1/out/data.jsonl"]
    assert open_store(url, RunOptions.from_env()).manifest("s", "d1") == manifest
    assert not store.checkpoint_dir("s", "d1").exists()


def test_two_processes_racing_for_a_stage_run_it_once(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "reader"))
    url, log = (tmp_path / "shared").as_uri(), tmp_path / "log.txt"
    spawn = multiprocessing.get_context("spawn")
    runs = [spawn.Process(target=race, args=(url, str(tmp_path / f"machine-{i}"), str(log), 0.9))
            for i in range(2)]
    for p in runs:
        p.start()
    for p in runs:
        p.join(120)
    assert [p.exitcode for p in runs] == [0, 0]
    lines = [line.split() for line in log.read_text().splitlines()]
    assert sorted(status for _, status, _ in lines) == ["cached", "ran"]
    winner = next(pid for pid, status, _ in lines if status == "ran")
    loser_at = next(float(t) for _, status, t in lines if status == "cached")
    assert loser_at - next(float(t) for _, status, t in lines if status == "ran") >= 1.5  # waited the run out
    store = RemoteArtifactStore(url, RunOptions.from_env())
    assert store.manifest("s", "d1")["outputs"] == {"dataset": "out/data.jsonl"}
    assert store.fs.cat_file(f"{store.base}/s/d1/out/data.jsonl") == f"{winner}\n".encode()
    assert store.fs.ls(f"{store.base}/s/d1.lock", detail=False) == []


def test_a_dead_owners_lock_is_taken_once_its_lease_expires(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    url, lease = (tmp_path / "shared").as_uri(), 1.0
    spawn = multiprocessing.get_context("spawn")
    ready = spawn.Event()
    owner = spawn.Process(target=hold_and_die, args=(url, lease, ready))
    owner.start()
    assert ready.wait(60)
    fs, folder = fsspec.filesystem("file"), str(tmp_path / "shared" / "s" / "d1.lock")
    owner.kill()
    owner.join()
    expires = json.loads(fs.cat_file(f"{folder}/0000000000"))["expires"]  # its heartbeat's last renewal
    with RemoteArtifactStore(url, RunOptions.from_env(), lease_s=lease).lock("s", "d1"):
        taken = time.time()
        assert fs.ls(folder, detail=False) == [f"{folder}/0000000001"]  # the next number; the dead one deleted
    # not before the dead owner's lease ran out, and within a poll (lease / 4) after it
    assert expires - 0.05 <= taken <= expires + lease / 4 + 0.5


def test_a_live_lease_is_renewed_past_its_length_and_a_stalled_owner_loses_the_lock(tmp_path):
    fs, folder = fsspec.filesystem("file"), str(tmp_path / "s" / "d1.lock")
    # Renewed: the heartbeat pushes the expiry past the first lease. No contender waits here, so a loaded
    # machine's late heartbeat only delays a renewal (waited for up to a minute) and cannot lose the lock.
    holder = LeaseLock(fs, folder, "s/d1", lease_s=1.5)
    holder.acquire()
    first, deadline = holder._read(holder.generation)["expires"], time.time() + 60
    while not (time.time() > first and holder._read(holder.generation)["expires"] > time.time()):
        assert time.time() < deadline, "the lease was not renewed past its first expiry"
        time.sleep(0.02)
    holder.release()
    # Live: a contender waits for the holder (a lease no scheduling delay outlasts) and takes the lock once
    # it is released
    holder = LeaseLock(fs, folder, "s/d1", lease_s=60)
    holder.acquire()
    taken = []
    contender = threading.Thread(target=lambda: (LeaseLock(fs, folder, "s/d1", 60, poll_s=0.05).acquire(),
                                                 taken.append(time.time())))
    contender.start()
    time.sleep(0.5)
    assert not taken
    released = time.time()
    holder.release()
    contender.join(10)
    assert taken and taken[0] >= released

    # A stalled owner: its heartbeat stops; the lease expires; another run takes the lock; it must not publish.
    fs.rm(folder, recursive=True)
    stalled = LeaseLock(fs, folder, "s/d1", lease_s=0.6)
    stalled.acquire()
    stalled._stop.set()
    stalled._heartbeat.join()
    time.sleep(0.7)
    breaker = LeaseLock(fs, folder, "s/d1", lease_s=0.6)
    breaker.acquire()
    with pytest.raises(LockLost, match="lost the lock"):
        stalled.check()
    stalled.release()  # deletes nothing of the new holder's
    assert fs.ls(folder, detail=False) == [f"{folder}/0000000001"]
    breaker.check()
    breaker.release()


def test_a_stopped_run_frees_its_locks_at_once_not_a_lease_later(tmp_path):
    fs, folder = fsspec.filesystem("file"), str(tmp_path / "s" / "d1.lock")
    held = LeaseLock(fs, folder, "s/d1", lease_s=60)
    held.acquire()
    release_held()  # what SIGINT/SIGTERM of `alignflow run` does once its stages' processes are stopped
    assert fs.ls(folder, detail=False) == []
    started = time.monotonic()
    with LeaseLock(fs, folder, "s/d1", lease_s=60):  # the next run takes it at once, not 60 s later
        assert time.monotonic() - started < 5
        held.release()  # the stopped stage's own unwinding, if it gets that far: deletes nothing of the new holder's
        assert fs.ls(folder, detail=False) == [f"{folder}/0000000000"]


class NoExclusiveFS(AbstractFileSystem):
    protocol = "noexcl"


class S3FileSystem(MemoryFileSystem):  # named as s3fs's class: the version check applies
    protocol = "fakes3"


def test_a_backend_without_exclusive_create_is_refused_unless_the_user_opts_out(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "cache"))
    fsspec.register_implementation("noexcl", NoExclusiveFS, clobber=True)
    fsspec.register_implementation("fakes3", S3FileSystem, clobber=True)
    with pytest.raises(SpecError, match=r"noexcl://bucket: fsspec's NoExclusiveFS cannot create a file only if "
                                        r"absent .* ALIGNFLOW_ARTIFACT_LOCK=none"):
        open_store("noexcl://bucket", RunOptions.from_env())
    monkeypatch.setattr(remote_store.md, "version", lambda dist: "2025.3.0")
    with pytest.raises(SpecError, match=r"s3fs 2025.3.0 cannot create a file only if absent; s3fs>=2025.7.0 can"):
        open_store("fakes3://bucket/prefix", RunOptions.from_env())
    monkeypatch.setattr(remote_store.md, "version", lambda dist: "2025.9.0")
    assert open_store("fakes3://bucket/prefix", RunOptions.from_env()).locking == "lease"
    monkeypatch.setenv(LOCK_ENV, "none")
    assert open_store("noexcl://bucket", RunOptions.from_env()).locking == "none"
    monkeypatch.setenv(LOCK_ENV, "off")
    with pytest.raises(SpecError, match="ALIGNFLOW_ARTIFACT_LOCK='off': expected 'lease' or 'none'"):
        open_store("memory://x", RunOptions.from_env())
