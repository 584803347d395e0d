"""execute_stage records the environment: a `fingerprint` in the manifest, `alignflow.fp.*` tags on the run."""

import pytest
import torch

from alignflow.core import fingerprint as fp
from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import load_spec
from alignflow.flows.launch.execute import Launcher, execute_stage
from alignflow.flows.options import RunOptions
from alignflow.flows.plan import plan_pipeline
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.tracking import Tracker

pytestmark = pytest.mark.stage


def _tracker(project) -> Tracker:
    tracker = Tracker(project, "fingerprint")
    tracker.parent_id = tracker.client.create_run(tracker.experiment_id).info.run_id
    return tracker


def test_manifest_and_run_record_the_fingerprint_and_a_cached_stage_keeps_where_it_ran(tmp_path, make_project,
                                                                                         monkeypatch):
    project = make_project(tmp_path)
    plugins = get_plugins()
    plan = plan_pipeline(load_spec(project / "chain.yaml"), project, plugins)["a"]
    store, tracker = ArtifactStore(project / "artifacts"), _tracker(project)
    ran = execute_stage(plan, {}, store, tracker, plugins, Launcher())
    recorded = store.manifest("a", plan.digest)["fingerprint"]
    assert recorded["torch"] == torch.__version__
    assert recorded["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert recorded["plugins"] == {"alignflow": plan.versions["plugins"]["selector/dedup"]["version"]}
    assert recorded["precision"] is None  # a select stage has no precision setting
    assert fp.differences(recorded, fp.fingerprint(None, recorded["plugins"], recorded["torch_threads"])) == {}
    tags = tracker.client.get_run(ran.mlflow_run_id).data.tags
    assert tags["alignflow.fp.cpu_capability"] == recorded["cpu_capability"]
    assert tags["alignflow.fp.torch"] == torch.__version__
    assert tags["alignflow.fp.transformers"] == recorded["transformers"]
    assert tags["alignflow.fp.plugins.alignflow"] == recorded["plugins"]["alignflow"]

    # another CPU: the same digest, so the stage is reused, and its run says where the outputs were computed
    fp.cpu.cache_clear()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "FAKE512")
    try:
        again = plan_pipeline(load_spec(project / "chain.yaml"), project, plugins)["a"]
        cached = execute_stage(again, {}, store, tracker, plugins, Launcher())
    finally:
        fp.cpu.cache_clear()
    assert (again.digest, cached.status) == (plan.digest, "cached")
    assert tracker.client.get_run(cached.mlflow_run_id).data.tags["alignflow.fp.cpu_capability"] \
        == recorded["cpu_capability"]


def test_a_failed_stage_run_is_tagged_with_the_fingerprint(tmp_path, make_project, monkeypatch):
    from alignflow.flows.launch.execute import StageFailed
    from alignflow.flows.stages.runners import RUNNERS

    project = make_project(tmp_path)
    plugins = get_plugins()
    plan = plan_pipeline(load_spec(project / "chain.yaml"), project, plugins)["a"]
    monkeypatch.setitem(RUNNERS, "select", lambda ctx: 1 / 0)
    tracker = _tracker(project)
    with pytest.raises(StageFailed):
        execute_stage(plan, {}, ArtifactStore(project / "artifacts"), tracker, plugins, Launcher())
    run = tracker.client.search_runs([tracker.experiment_id], "tags.`alignflow.status` = 'failed'")[0]
    assert run.data.tags["alignflow.fp.torch"] == torch.__version__
    assert "ZeroDivisionError" in run.data.tags["alignflow.error"]


@pytest.mark.parametrize("parallel, expected", [(1, "auto"), (2, False)])
def test_stages_side_by_side_keep_auto_overlap_off(monkeypatch, tmp_path, parallel, expected):
    """Two training stages at once share the cores: neither has one spare for a rollout worker, so `auto` is off."""
    from alignflow.core.spec.schema import StageSpec
    from alignflow.core.spec.settings import RLSettings
    from alignflow.flows.launch import execute
    from alignflow.flows.stages import StageContext

    seen = []
    monkeypatch.setitem(execute.RUNNERS, "rl", lambda ctx: seen.append(ctx.settings.async_rollouts))
    spec = StageSpec(kind="rl", inputs={"model": "m", "dataset": "d.jsonl"}, algorithm="grpo")
    ctx = StageContext("rl", spec, RLSettings(), {}, tmp_path / "work", tmp_path / "checkpoints", 0,
                       lambda m, s: None, get_plugins())
    execute.Launcher(RunOptions(parallel=parallel)).call_runner("rl", ctx, [])
    assert seen == [expected]
