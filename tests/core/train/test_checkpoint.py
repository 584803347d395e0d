"""Checkpoints survive a real SIGKILL bit for bit, a damaged one is skipped, never loaded, and a full disk fails
the save without touching the checkpoints before it."""

from __future__ import annotations

import errno
import json
import logging
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import engine_worker as worker
from helpers.tmpfs import small_tmpfs
from alignflow.core.train import checkpoint
from alignflow.core.train.checkpoint import MARKER, CheckpointError
from alignflow.core.train.engine import Engine
from alignflow.core.spec.settings import TrainSettings


def train(out, steps: int, total: int = 6, resume=True, after_step=None, **settings) -> Engine:
    """A few steps of a tiny model with a fixed data order, saving every 2 steps; `after_step(step)` after each."""
    torch.manual_seed(0)
    settings = TrainSettings(batch_size=4, micro_batch_size=4, lr=1e-2, save_every=2, **settings)
    engine = Engine.create(worker.tiny_model(), settings, total_steps=total, out_dir=out, resume=resume,
                           auto_precision="fp32")
    ids, mask = worker.dataset(4 * total)
    for step in engine.steps():
        if step >= steps:
            break
        rows = slice(4 * step, 4 * step + 4)
        logp = worker.per_token_loss(engine.model, ids[rows], torch.ones(4, device=engine.device))
        engine.backward((logp * mask[rows]).sum() / mask[rows].sum())
        engine.step()
        engine.maybe_save({"index": 4 * (step + 1)})
        if after_step is not None:
            after_step(engine.step_count)
    return engine


@pytest.mark.system
def test_killed_run_resumes_to_the_same_weights(tmp_path):
    """SIGKILL after step 3 (last checkpoint: step 2); the resumed run ends exactly where an
    uninterrupted one does, data order and global RNG draws included."""
    cmd = [sys.executable, str(worker.__file__), str(tmp_path / "killed"), "--steps", "6"]
    # a process of its own: not the group this test process may already lead
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    killed = subprocess.Popen([*cmd, "--kill-after", "3"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        reference = worker.run_here(tmp_path / "reference", steps=6)
        killed.wait(timeout=600)
    finally:  # never left running by a timeout
        if killed.poll() is None:
            killed.kill()
            killed.wait()
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()] == ["step-00000002"]

    resumed = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)  # killed on timeout
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    result = torch.load(tmp_path / "killed" / "result.pt", weights_only=False)
    assert result["losses"] == reference["losses"][2:]  # steps 3..6, redone from step 2
    for name, w in reference["weights"].items():
        assert torch.equal(result["weights"][name], w), name


@pytest.mark.parametrize("zero,dtype", [(1, "fp32"), (2, "bf16"), (3, "fp32")])
def test_resume_restores_zero_optimizer_state(tmp_path, zero, dtype):
    straight = train(tmp_path / "straight", steps=4, zero_stage=zero, dtype=dtype).full_state_dict()
    train(tmp_path / "split", steps=2, zero_stage=zero, dtype=dtype)
    resumed = train(tmp_path / "split", steps=4, zero_stage=zero, dtype=dtype)
    for name, w in resumed.full_state_dict().items():
        assert torch.equal(w, straight[name]), name


def test_critic_resumes_at_its_policy_step(tmp_path):
    """A critic saved after its policy may be one checkpoint ahead when killed; it follows the policy."""
    train(tmp_path / "policy", steps=2)
    train(tmp_path / "critic", steps=4)  # the policy's step-4 save never happened
    policy = train(tmp_path / "policy", steps=0)
    critic = train(tmp_path / "critic", steps=0, resume=policy.step_count)
    assert policy.step_count == critic.step_count == 2


def corrupt_truncate(folder):
    states = folder / "ds" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[:100])


def corrupt_flip(folder):
    states = folder / "ds" / "mp_rank_00_model_states.pt"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))


def corrupt_marker(folder):
    (folder / MARKER).unlink()


@pytest.mark.parametrize("damage", [corrupt_truncate, corrupt_flip, corrupt_marker])
def test_damaged_checkpoint_falls_back_to_previous(tmp_path, caplog, damage):
    at2 = train(tmp_path / "run", steps=2).full_state_dict()  # checkpoint at step 2
    train(tmp_path / "run", steps=4)  # resumes at 2, checkpoints at 4
    damage(tmp_path / "run" / "checkpoints" / "step-00000004")
    with caplog.at_level(logging.WARNING, logger="alignflow.core.train.checkpoint"):
        engine = train(tmp_path / "run", steps=0)  # just resume
    assert engine.step_count == 2 and engine.data_state == {"index": 8}
    assert "step-00000004" in caplog.text
    for name, w in engine.full_state_dict().items():
        assert torch.equal(w, at2[name]), name
    with pytest.raises(CheckpointError, match="step-00000004"):
        train(tmp_path / "run", steps=0, resume=4)  # asking for it by step is an error, not a fallback


def test_partial_save_is_ignored_and_only_two_are_kept(tmp_path):
    train(tmp_path / "run", steps=6)
    root = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
    assert json.loads((root / "step-00000006" / MARKER).read_text())["step"] == 6
    (root / ".tmp-step-00000008" / "ds").mkdir(parents=True)  # a save killed before its rename
    assert checkpoint.find(root) == root / "step-00000006"


def test_verify_names_what_is_wrong(tmp_path):
    (tmp_path / "a.pt").write_bytes(b"x" * 10)
    checkpoint._write_marker(tmp_path, step=1)
    assert checkpoint.verify(tmp_path) is None
    (tmp_path / "a.pt").write_bytes(b"x" * 9)
    assert "truncated" in checkpoint.verify(tmp_path)
    (tmp_path / "a.pt").write_bytes(b"y" * 10)
    assert "checksum" in checkpoint.verify(tmp_path)
    (tmp_path / "a.pt").unlink()
    assert "missing" in checkpoint.verify(tmp_path)


def test_rng_state_round_trips():
    state = checkpoint.rng_state()
    drawn = (random.random(), np.random.rand(), torch.rand(1))
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1)) == drawn


def folder_bytes(folder) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def test_full_disk_fails_the_save_keeps_the_last_checkpoint_and_resumes_once_there_is_room(tmp_path, caplog):
    """The disk fills up after the step-2 checkpoint: saving step 4 fails naming its folder, the filesystem and
    the step a rerun resumes from; its partial folder is gone and step 2 is intact; with room again the rerun
    resumes at step 2 and ends on the weights of an uninterrupted run."""
    straight = train(tmp_path / "straight", steps=6).full_state_dict()
    root = tmp_path / "run" / "checkpoints"
    with small_tmpfs(root, 8 << 20) as disk:
        def fill_after_first_save(step):
            if step == 2:  # half a checkpoint left free: the next one cannot fit
                disk.fill(leave=folder_bytes(root / "step-00000002") // 2)

        with pytest.raises(CheckpointError) as failed:
            train(tmp_path / "run", steps=6, after_step=fill_after_first_save)
        message = str(failed.value)
        assert f"step 4 to {root / '.tmp-step-00000004'}" in message, message
        assert "out of space" in message and f"Free space on {root} and rerun: the stage resumes from step 2" \
            in message, message
        assert sorted(p.name for p in root.iterdir()) == [".filler", "step-00000002"]  # no .tmp-step-* left
        assert checkpoint.verify(root / "step-00000002") is None
        assert checkpoint.find(root) == root / "step-00000002"

        disk.make_room()
        with caplog.at_level(logging.INFO, logger="alignflow.core.train.engine"):
            resumed = train(tmp_path / "run", steps=6)
        assert "step-00000002 at step 2" in caplog.text
        assert sorted(p.name for p in root.iterdir()) == ["step-00000004", "step-00000006"]
        for name, w in resumed.full_state_dict().items():
            assert torch.equal(w, straight[name]), name


class Refusing:
    """An engine whose save_checkpoint writes part of a checkpoint, then raises `error`."""

    def __init__(self, error: Exception):
        self.error = error

    def save_checkpoint(self, path, **kwargs):
        (Path(path) / "ds").mkdir()
        (Path(path) / "ds" / "part.pt").write_bytes(b"x" * 100)
        raise self.error


def checkpoint_at_2(root):
    """A complete checkpoint of step 2 under `root`, as `checkpoint.save` leaves one."""
    (root / "step-00000002").mkdir(parents=True)
    (root / "step-00000002" / "w.pt").write_bytes(b"w")
    checkpoint._write_marker(root / "step-00000002", step=2)


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "out of space .*Free space on /"),
                                          (errno.EDQUOT, "out of space .*Free space on /"), (errno.EACCES, "Fix that")])
def test_an_os_error_names_the_folder_and_what_to_do(tmp_path, code, advice):
    """By its errno a full disk or quota says to free space (wherever the disk stands now); another OS error says
    to fix it. The partial folder is removed and step 2 is kept."""
    root = tmp_path / "checkpoints"
    checkpoint_at_2(root)
    error = OSError(code, os.strerror(code), str(root / ".tmp-step-00000004" / "ds" / "x.pt"))
    with pytest.raises(CheckpointError, match=rf"step 4 to .*\.tmp-step-00000004: .*{advice}.* and rerun: "
                                              r"the stage resumes from step 2") as failed:
        checkpoint.save(Refusing(error), root, 4, None)
    assert f"[Errno {code}] {os.strerror(code)}" in str(failed.value) and failed.value.__cause__ is error
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]
    assert checkpoint.verify(root / "step-00000002") is None


def test_a_lost_peer_is_raised_as_it_is(tmp_path):
    """No write failed: the error stays what it is (the launcher tells a lost peer from a cause by it); the
    partial folder is removed all the same."""
    root = tmp_path / "checkpoints"
    checkpoint_at_2(root)
    lost = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
    with pytest.raises(RuntimeError) as failed:
        checkpoint.save(Refusing(lost), root, 4, None)
    assert failed.value is lost
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002"]
