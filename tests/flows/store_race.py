"""Helpers and children for tests/flows/test_artifact_store.py and test_checkpoint_store.py: spawned
processes import this module, not the tests (which import Prefect and torch), so each starts in a second
instead of twenty."""

from __future__ import annotations

import os
import time

from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.options import RunOptions
from alignflow.flows.store.url import RemoteArtifactStore


def finish_stage(store: ArtifactStore, stage: str, digest: str, text: str) -> dict:
    """What `execute_stage` does around a runner that writes one dataset."""
    work = store.fresh_work_dir(stage, digest)
    (work / "data.jsonl").write_text(text)
    return store.finalise(stage, digest, {"dataset": work / "data.jsonl"},
                          {"digest": digest, "metrics": {"rows": 1.0}}, {"loss": [[1, 0.5], [2, 0.25]]})


def race(url: str, cache: str, log: str, lease_s: float) -> None:
    """One process's run of stage `s`: the check-and-run `execute_stage` does under the stage lock."""
    store = RemoteArtifactStore(url, RunOptions(cache=cache), lease_s=lease_s)
    with store.lock("s", "d1"):
        ran = store.manifest("s", "d1") is None
        with open(log, "a") as f:
            f.write(f"{os.getpid()} {'ran' if ran else 'cached'} {time.time()}\n")
        if ran:
            time.sleep(1.5)  # over a lease: the heartbeat must keep the other process out
            finish_stage(store, "s", "d1", f"{os.getpid()}\n")


def hold_and_die(url: str, lease_s: float, ready) -> None:
    """Take the lock and sleep until killed (SIGKILL: the lock is never released)."""
    store = RemoteArtifactStore(url, RunOptions.from_env(), lease_s=lease_s)
    held = store.lock("s", "d1")
    held.__enter__()
    ready.set()
    time.sleep(60)  # `held` stays referenced: collected, its generator would release the lock
