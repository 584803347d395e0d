"""Checkpoints mirrored to an artifact store at a URL (core/train/checkpoint_store.py): uploaded marker last and
rotated as on the machine, the newest fetched by another machine, and a stage killed on one machine resumed
on another to the weights of an uninterrupted run."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.core.train import checkpoint

from alignflow.core.train import checkpoint_store
from alignflow.flows.options import CACHE_ENV, RunOptions
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.store.url import open_store
from reports import statuses
from store_race import finish_stage

pytestmark = pytest.mark.system


def fake_checkpoint(root: Path, step: int, keep: int = 2) -> Path:
    """What `checkpoint.save` does on rank 0 once the engine wrote its files: the marker, the rotation,
    the upload."""
    final = root / f"step-{step:08d}"
    (final / "ds").mkdir(parents=True)
    (final / "ds" / "weights.pt").write_bytes(f"weights {step}".encode())
    (final / "rng-rank0.pt").write_bytes(f"rng {step}".encode())
    checkpoint._write_marker(final, step)
    for _, old in checkpoint.step_dirs(root)[:-keep]:
        shutil.rmtree(old)
    checkpoint_store.upload(root, final)
    return final


def test_checkpoints_go_to_the_store_marker_last_rotated_as_here_and_the_newest_comes_back_elsewhere(
        url, tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-a"))
    store = open_store(url, RunOptions.from_env())
    fs, remote = store.fs, store.remote("s", "d1", "checkpoints")
    puts, gets = [], []
    put_file, get_file = type(fs).put_file, type(fs).get_file
    monkeypatch.setattr(type(fs), "put_file", lambda self, lpath, rpath, **kw: (
        puts.append(rpath[len(remote) + 1:]), put_file(self, lpath, rpath, **kw)))
    monkeypatch.setattr(type(fs), "get_file", lambda self, rpath, lpath, **kw: (
        gets.append(rpath[len(remote) + 1:]), get_file(self, rpath, lpath, **kw)))
    with store.lock("s", "d1"):
        store.fresh_work_dir("s", "d1")
        root = store.checkpoint_dir("s", "d1")
        fake_checkpoint(root, 2)
        assert puts == ["step-00000002/ds/weights.pt", "step-00000002/rng-rank0.pt", "step-00000002/COMPLETE.json"]
        # an rl stage: the critic's checkpoint first, then the policy's; killed after the critic's step 8
        critic = root / "critic" / "checkpoints"
        for step in (4, 6):
            fake_checkpoint(critic, step)
            fake_checkpoint(root, step)
        fake_checkpoint(critic, 8)
    # the store keeps what the machine keeps, the newest two of each
    assert [s for s, _ in checkpoint_store.remote_steps(fs, remote)] == [4, 6]
    assert [s for s, _ in checkpoint_store.remote_steps(fs, f"{remote}/critic/checkpoints")] == [6, 8]

    # Machine B: the newest policy step, 6, and the critic's at the policy's step (not its newest, 8)
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-b"))
    other = open_store(url, RunOptions.from_env())
    with other.lock("s", "d1"):
        other.fresh_work_dir("s", "d1")
    there = other.checkpoint_dir("s", "d1")
    assert sorted(gets) == ["critic/checkpoints/step-00000006/COMPLETE.json",
                            "critic/checkpoints/step-00000006/ds/weights.pt",
                            "critic/checkpoints/step-00000006/rng-rank0.pt",
                            "step-00000006/COMPLETE.json", "step-00000006/ds/weights.pt", "step-00000006/rng-rank0.pt"]
    assert gets[2] == "step-00000006/COMPLETE.json"  # each checkpoint's marker last
    assert [p.name for _, p in checkpoint.step_dirs(there)] == ["step-00000006"]
    assert [p.name for _, p in checkpoint.step_dirs(there / "critic" / "checkpoints")] == ["step-00000006"]
    assert checkpoint.find(there) == there / "step-00000006"  # every file matches its marker
    assert (there / "step-00000006" / "ds" / "weights.pt").read_bytes() == b"weights 6"
    assert not list(there.rglob(".tmp-*"))

    # Machine A again: its own checkpoints are as new as the store's, so nothing is downloaded
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-a"))
    gets.clear()
    with store.lock("s", "d1"):
        store.fresh_work_dir("s", "d1")
        assert gets == []
        finish_stage(store, "s", "d1", "done\n")
    assert not fs.exists(remote)  # a finished stage is never resumed: its checkpoints leave the store too


def test_a_stage_on_a_local_store_uploads_nothing(tmp_path):
    root = tmp_path / "artifacts" / "s" / "d1" / "checkpoints"
    assert checkpoint_store.store_of(root) is None
    fake_checkpoint(root, 2)  # no store: the upload is a no-op
    assert [p.name for _, p in checkpoint.step_dirs(root)] == ["step-00000002"]


# sft saves every 2 of its 8 steps, so a kill after its first checkpoint lands mid-stage.
SFT = """
name: resume-elsewhere
seed: 0
stages:
  data:
    kind: select
    inputs: {dataset: data/sft.jsonl}
    selectors: [{name: subsample, config: {n: 64}}]
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: "stage:data"}
    algorithm: sft
    settings: {lr: 2.0e-3, max_steps: 8, batch_size: 8, micro_batch_size: 8, max_length: 96,
               save_every: 2, log_every: 2}
"""


def test_a_stage_killed_on_one_machine_resumes_on_another_from_the_stores_checkpoint(tmp_path, monkeypatch):
    import torch
    from prefect.settings import PREFECT_API_URL
    from safetensors.torch import load_file

    from alignflow.core.task.arithmetic import write_datasets

    project = tmp_path / "project"
    write_datasets(project / "data")
    (project / "p.yaml").write_text(SFT)
    url, shared = (tmp_path / "shared").as_uri(), tmp_path / "shared"
    # Machine A: `alignflow run` in its own cache, SIGKILLed (the machine gone) once sft's first
    # checkpoint is in the store; a short lease, so machine B need not wait 120 s for the dead lock.
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update({CACHE_ENV: str(tmp_path / "machine-a"), "ALIGNFLOW_LOCK_LEASE_S": "3", "OMP_NUM_THREADS": "1",
                "PREFECT_API_URL": PREFECT_API_URL.value()})
    with (tmp_path / "machine-a.log").open("w") as out:
        run = subprocess.Popen([str(Path(sys.executable).with_name("alignflow")), "run", "p.yaml", "--artifacts",
                                url], cwd=project, env=env, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)
    deadline = time.monotonic() + 600
    while not (marked := sorted(shared.glob("sft/*/checkpoints/step-*/COMPLETE.json"))):
        assert run.poll() is None and time.monotonic() < deadline, (tmp_path / "machine-a.log").read_text()[-3000:]
        time.sleep(0.05)
    os.killpg(run.pid, signal.SIGKILL)
    run.wait()
    folder = marked[0].parents[2]
    assert int(marked[0].parent.name.removeprefix("step-")) < 8 and not (folder / "manifest.json").exists()
    local_a = list((tmp_path / "machine-a").rglob("sft/*/checkpoints/step-*"))
    assert local_a  # machine A's checkpoint, which machine B cannot see

    # Machine B: an empty cache; the stage resumes from the store's checkpoint
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-b"))
    resumed = run_pipeline(project / "p.yaml", [], project, artifacts=url)
    assert statuses(resumed) == {"data": "cached", "sft": "resumed"}, [s.error for s in resumed.stages]
    assert not (folder / "checkpoints").exists()  # published: its checkpoints left the store

    # Uninterrupted, on a third machine with a local store: the same digest, bitwise the same weights
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "machine-c"))
    clean = run_pipeline(project / "p.yaml", [], project, artifacts=tmp_path / "local")
    assert statuses(clean) == {"data": "ran", "sft": "ran"}
    sft = [next(s for s in report.stages if s.name == "sft") for report in (resumed, clean)]
    assert Path(sft[0].artifact).name == Path(sft[1].artifact).name == folder.name
    got, want = (load_file(Path(s.artifact) / "out" / "model" / "model.safetensors") for s in sft)
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
