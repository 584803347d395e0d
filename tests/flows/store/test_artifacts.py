import json
import threading
import time

import pytest

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import load_spec
from alignflow.flows.store.artifacts import ArtifactStore, write_json_atomic
from alignflow.flows.launch.execute import Launcher, execute_stage
from alignflow.flows.plan import plan_pipeline
from alignflow.flows.stages.runners import RUNNERS
from alignflow.flows.tracking import Tracker


@pytest.mark.stage
def test_two_concurrent_runs_of_a_stage_run_it_once(tmp_path, make_project, monkeypatch):
    project = make_project(tmp_path)
    plugins = get_plugins()
    plan = plan_pipeline(load_spec(project / "chain.yaml"), project, plugins)["a"]
    store = ArtifactStore(project / "artifacts")
    calls = []

    def slow_select(ctx):
        calls.append(ctx.name)
        time.sleep(1.0)  # long enough that the second run arrives while the first is writing
        return select(ctx)

    select = RUNNERS["select"]
    monkeypatch.setitem(RUNNERS, "select", slow_select)
    results = []

    def run():
        results.append(execute_stage(plan, {}, store, tracker, plugins, Launcher()))

    tracker = Tracker(project, "concurrency")
    tracker.parent_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["a"]
    assert sorted(r.status for r in results) == ["cached", "ran"]
    folder = store.folder("a", plan.digest)
    assert sorted(p.name for p in folder.iterdir()) == [".checked.json", "curves.json", "manifest.json", "out"]
    assert len((folder / "out" / "data.jsonl").read_text().splitlines()) == 8


def test_finalise_moves_work_to_out_drops_checkpoints_and_writes_manifest_last(tmp_path):
    store = ArtifactStore(tmp_path)
    work = store.fresh_work_dir("s", "d1")
    (store.checkpoint_dir("s", "d1") / "step-1").mkdir()
    (work / "model").mkdir()
    (work / "model" / "w.bin").write_bytes(b"x")
    assert store.manifest("s", "d1") is None
    manifest = store.finalise("s", "d1", {"model": work / "model"}, {"digest": "d1", "metrics": {}}, {})
    assert manifest["outputs"] == {"model": "out/model"}
    assert store.outputs(manifest, "s")["model"].joinpath("w.bin").read_bytes() == b"x"
    assert not store.checkpoint_dir("s", "d1").exists() and not work.exists()
    assert store.manifest("s", "d1") == manifest


def test_atomic_write_leaves_no_temp_files(tmp_path):
    write_json_atomic(tmp_path / "m.json", {"a": 1})
    write_json_atomic(tmp_path / "m.json", {"a": 2})
    assert json.loads((tmp_path / "m.json").read_text()) == {"a": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]
