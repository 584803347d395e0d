"""A disk that fills up during a stage's checkpoint write: the stage fails with an error naming it and the folder,
the checkpoint before is kept, and once there is room again the rerun resumes from it."""

import logging

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import load_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.core.train import checkpoint
from alignflow.flows.launch.execute import Launcher, StageFailed, execute_stage
from alignflow.flows.plan import plan_pipeline
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.tracking import Tracker
from helpers.tmpfs import small_tmpfs

pytestmark = [pytest.mark.stage, pytest.mark.usefixtures("one_thread")]

PIPELINE = """
name: full-disk
seed: 0
stages:
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: small.jsonl}
    algorithm: sft
    settings: {lr: 2.0e-3, max_steps: 4, batch_size: 8, micro_batch_size: 8, max_length: 64, save_every: 2,
               lr_scheduler: constant}
"""


def weights(store: ArtifactStore, digest: str) -> dict[str, torch.Tensor]:
    return load_file(store.outputs(store.manifest("sft", digest), "sft")["model"] / "model.safetensors")


def test_a_full_disk_fails_the_stage_by_name_and_the_rerun_resumes_once_there_is_room(tmp_path, monkeypatch,
                                                                                       caplog):
    rows = write_datasets(tmp_path / "data")["sft"].read_text().splitlines()[:64]
    (tmp_path / "small.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "full.yaml").write_text(PIPELINE)
    plugins = get_plugins()
    plan = plan_pipeline(load_spec(tmp_path / "full.yaml"), tmp_path, plugins)["sft"]
    tracker = Tracker(tmp_path, "full-disk")
    tracker.parent_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    straight = ArtifactStore(tmp_path / "straight")
    execute_stage(plan, {}, straight, tracker, plugins, Launcher())

    store = ArtifactStore(tmp_path / "artifacts")
    root = store.checkpoint_dir("sft", plan.digest)
    with small_tmpfs(root, 64 << 20) as disk:
        save = checkpoint.save

        def then_fill(ds, folder, step, *args, **kwargs):
            """Another writer fills the disk once the step-2 checkpoint is saved, leaving half of one free."""
            saved = save(ds, folder, step, *args, **kwargs)
            if step == 2:
                disk.fill(leave=sum(p.stat().st_size for p in saved.rglob("*") if p.is_file()) // 2)
            return saved

        monkeypatch.setattr(checkpoint, "save", then_fill)
        with pytest.raises(StageFailed) as failed:
            execute_stage(plan, {}, store, tracker, plugins, Launcher())
        message = str(failed.value)  # what `alignflow run` prints in its summary for the stage
        assert message.startswith("stage 'sft' failed") and "CheckpointError" in message, message
        assert f"step 4 to {root / '.tmp-step-00000004'}" in message, message
        assert f"Free space on {root} and rerun: the stage resumes from step 2" in message, message
        assert sorted(p.name for p in root.iterdir()) == [".filler", "step-00000002"]  # no .tmp-step-* left
        assert checkpoint.verify(root / "step-00000002") is None
        assert checkpoint.find(root) == root / "step-00000002"
        assert store.manifest("sft", plan.digest) is None  # nothing published

        disk.make_room()
        monkeypatch.setattr(checkpoint, "save", save)
        with caplog.at_level(logging.INFO, logger="alignflow.core.train.engine"):
            rerun = execute_stage(plan, {}, store, tracker, plugins, Launcher())
    assert "step-00000002 at step 2" in caplog.text
    assert rerun.status == "resumed" and rerun.metrics["steps"] == 4
    ours, theirs = weights(store, plan.digest), weights(straight, plan.digest)
    assert ours.keys() == theirs.keys()
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name
