"""End to end on the tiny model: a select stage feeding chained and sibling SFT stages, run on Prefect's
server with MLflow's SQLite store; caching, partial reruns, and a SIGKILL resumed to identical weights."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from uuid import UUID

import pytest
import torch
from prefect import get_client
from prefect.client.schemas.filters import FlowRunFilter
from prefect.settings import PREFECT_API_URL
from safetensors.torch import load_file

from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.report import PipelineReport, StageReport
from alignflow.flows.tracking import Tracker
from reports import statuses


# data -> sft_a -> sft_b, and sft_c, a sibling of sft_a. sft_a saves every 5 of its 20 steps, so a
# kill after its first checkpoint lands mid-stage; sft_b also scores greedy answers on the test set.
STAGES = """
  data:
    kind: select
    inputs: {dataset: data/sft.jsonl}
    selectors: [{name: subsample, config: {n: 256}}]
  sft_a:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: "stage:data"}
    algorithm: sft
    settings: {lr: 2.0e-3, max_steps: 20, batch_size: 8, micro_batch_size: 8, max_length: 96,
               save_every: 5, log_every: 5}
"""
DESCENDANTS = """
  sft_b:
    kind: sft
    inputs: {model: "stage:sft_a", dataset: "stage:data", eval_dataset: data/test.jsonl}
    algorithm: sft
    rewards: [math_accuracy]
    settings: {lr: 1.0e-3, max_steps: 10, batch_size: 8, micro_batch_size: 4, max_length: 96,
               save_every: 5, log_every: 5, eval_fraction: 0.1, eval_limit: 8,
               eval_generation: {max_new_tokens: 24, temperature: 0.0}}
  sft_c:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: "stage:data"}
    algorithm: sft
    settings: {lr: 1.0e-3, max_steps: 10, batch_size: 8, micro_batch_size: 8, max_length: 96, save_every: 5}
"""
HEAD = "name: sft-e2e\nseed: 0\nstages:"


def stage(report, name: str):
    return next(s for s in report.stages if s.name == name)


def weights(report, name: str) -> dict[str, torch.Tensor]:
    return load_file(Path(stage(report, name).artifact) / "out" / "model" / "model.safetensors")


def task_states(flow_run_id: str, stages: int = 4, wait_s: float = 60.0) -> dict[str, str]:
    """{task run name: state name} of one flow run, read back from the Prefect server once it has all `stages`
    (Prefect 3's server records task runs from the events the run sends, after the run: a busy one lags)."""
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [UUID(flow_run_id)]}))
            states = {r.name: r.state.name for r in runs if r.state is not None}
            if len(states) >= stages or time.monotonic() > deadline:
                return states
            time.sleep(0.5)


pytestmark = [pytest.mark.system, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("sft-e2e")
    write_datasets(root / "data")  # the bundled task, as `alignflow data` writes it
    (root / "pipeline.yaml").write_text(HEAD + STAGES + DESCENDANTS)
    (root / "prefix.yaml").write_text(HEAD + STAGES)  # data and sft_a only: the same two digests
    return root


@pytest.fixture(scope="module", autouse=True)
def two_at_once():
    """Two training stages at once, as `alignflow run --parallel 2` allows."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ALIGNFLOW_PARALLEL_STAGES", "2")
        yield


@pytest.fixture(scope="module")
def first(project, prefect_server):
    report = run_pipeline(project / "pipeline.yaml", [], project)
    print(f"first run: {report.seconds:.1f} s inside the flow")
    return report


def test_first_run_trains_every_stage_in_order(first):
    assert statuses(first) == {"data": "ran", "sft_a": "ran", "sft_b": "ran", "sft_c": "ran"}
    a, b = stage(first, "sft_a"), stage(first, "sft_b")
    assert a.metrics["steps"] == 20.0 and b.metrics["steps"] == 10.0
    curve = json.loads((Path(a.artifact) / "curves.json").read_text())["loss"]
    assert [s for s, _ in curve] == [5, 10, 15, 20]
    assert curve[-1][1] < curve[0][1] < 4.5  # it learns: from ~ln(vocab) down
    # sft_b starts from sft_a's trained weights, not from a fresh tiny model
    manifest = json.loads((Path(b.artifact) / "manifest.json").read_text())
    assert manifest["inputs"]["model"]["resolved"] == str(Path(a.artifact) / "out" / "model")
    assert {"eval/loss", "eval/accuracy"} <= set(b.metrics)
    assert not (Path(a.artifact) / "checkpoints").exists()  # a finished stage keeps only its outputs
    # the siblings sft_a and sft_c train at the same time, one of them in a child process
    spans = {n: json.loads((Path(stage(first, n).artifact) / "manifest.json").read_text())["timings"]
             for n in ("sft_a", "sft_c")}
    assert max(t["started"] for t in spans.values()) < min(t["finished"] for t in spans.values()), spans
    assert task_states(first.run_id) == {"data": "Completed", "sft_a": "Completed",
                                         "sft_b": "Completed", "sft_c": "Completed"}


def test_a_stage_run_beside_a_sibling_gives_the_weights_it_gives_alone(first, project, tmp_path):
    data, sft_c = STAGES.split("  sft_a:")[0], "  sft_c:" + DESCENDANTS.split("  sft_c:")[1]
    (project / "alone.yaml").write_text(HEAD + data + sft_c)
    alone = run_pipeline(project / "alone.yaml", [], project, tmp_path / "artifacts")
    assert statuses(alone) == {"data": "ran", "sft_c": "ran"}
    beside, solo = weights(first, "sft_c"), weights(alone, "sft_c")
    for name, tensor in beside.items():
        assert torch.equal(solo[name], tensor), name
    assert stage(alone, "sft_c").metrics == stage(first, "sft_c").metrics


def test_a_stage_on_two_ranks_lands_where_one_process_does(first, project, tmp_path, monkeypatch):
    # `alignflow run --nproc 2`: sft_c on two data-parallel processes, 4 rows each of its 8 a step
    monkeypatch.setenv("ALIGNFLOW_NPROC", "2")
    data, sft_c = STAGES.split("  sft_a:")[0], "  sft_c:" + DESCENDANTS.split("  sft_c:")[1]
    (project / "ranks.yaml").write_text(HEAD + data + sft_c)
    # the two processes reach the engine: sft_c's 8 rows a step cannot split into micro-batches of 8 on each
    refused = run_pipeline(project / "ranks.yaml", [], project, tmp_path / "artifacts")
    assert "world size 2" in stage(refused, "sft_c").error
    ranks = run_pipeline(project / "ranks.yaml", ["sft_c.settings.micro_batch_size=4"], project,
                         tmp_path / "artifacts")
    assert statuses(ranks) == {"data": "cached", "sft_c": "ran"}  # data ran in the refused run
    assert mlflow_tags(project, ranks)["alignflow.nproc"] == "2"  # `alignflow reproduce` reruns with it
    one, two = weights(first, "sft_c"), weights(ranks, "sft_c")
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-4
    for key, value in stage(first, "sft_c").metrics.items():
        assert stage(ranks, "sft_c").metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


def mlflow_tags(project: Path, report: PipelineReport) -> dict[str, str]:
    from mlflow.tracking import MlflowClient

    from alignflow.flows.tracking import tracking_uri

    return MlflowClient(tracking_uri(project)).get_run(report.mlflow_run_id).data.tags


def test_second_run_is_all_cached_and_fast(first, project):
    again = run_pipeline(project / "pipeline.yaml", [], project)
    print(f"cached rerun: {again.seconds:.2f} s inside the flow")
    assert statuses(again) == {"data": "cached", "sft_a": "cached", "sft_b": "cached", "sft_c": "cached"}
    assert again.seconds < 15
    assert [s.artifact for s in again.stages] == [s.artifact for s in first.stages]
    assert [s.metrics for s in again.stages] == [s.metrics for s in first.stages]
    assert set(task_states(again.run_id).values()) == {"Cached"}


def test_a_cached_models_truncated_weights_are_found_and_the_stage_runs_again(first, project):
    """sft_c's weights cut in half after publishing: the next run does not consume them but trains sft_c
    again (the same weights: it is deterministic), and only sft_c."""
    before = {k: v.clone() for k, v in weights(first, "sft_c").items()}  # copies: the file is mapped, not read
    path = Path(stage(first, "sft_c").artifact) / "out" / "model" / "model.safetensors"
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    again = run_pipeline(project / "pipeline.yaml", [], project)
    assert statuses(again) == {"data": "cached", "sft_a": "cached", "sft_b": "cached", "sft_c": "ran"}
    assert path.stat().st_size == size
    after = weights(again, "sft_c")
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_changed_lr_reruns_that_stage_and_its_descendants_only(first, project):
    changed = run_pipeline(project / "pipeline.yaml", ["sft_a.settings.lr=1.0e-3"], project)
    assert statuses(changed) == {"data": "cached", "sft_a": "ran", "sft_b": "ran", "sft_c": "cached"}
    moved = [s.name for s, t in zip(first.stages, changed.stages) if s.artifact != t.artifact]
    assert moved == ["sft_a", "sft_b"]
    assert not torch.equal(weights(first, "sft_a")["model.norm.weight"],
                           weights(changed, "sft_a")["model.norm.weight"])


def test_failed_stage_skips_its_descendants_under_their_own_names(first, project):
    broken = run_pipeline(project / "pipeline.yaml", ["sft_a.inputs.model=builtin:nope"], project)
    assert statuses(broken) == {"data": "cached", "sft_a": "failed", "sft_b": "skipped", "sft_c": "cached"}
    assert "unknown built-in model 'nope'" in stage(broken, "sft_a").error
    assert task_states(broken.run_id) == {"data": "Cached", "sft_a": "Failed", "sft_b": "NotReady",
                                          "sft_c": "Cached"}


def kill_at_first_checkpoint(project: Path, artifacts: Path, timeout: float = 600) -> Path:
    """`alignflow run prefix.yaml` in its own process group, SIGKILLed once sft_a has a checkpoint."""
    # the harness's server, not a second ephemeral one; and not this process's torch.distributed rank
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1")
    log = (artifacts.parent / "killed.log").open("w")
    proc = subprocess.Popen([str(Path(sys.executable).with_name("alignflow")), "run", "prefix.yaml",
                             "--artifacts", str(artifacts)], cwd=project, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + timeout
    try:
        while not (found := sorted(artifacts.glob("sft_a/*/checkpoints/step-*/COMPLETE.json"))):
            assert proc.poll() is None, (artifacts.parent / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint before the timeout"
            time.sleep(0.05)
    finally:
        with contextlib.suppress(ProcessLookupError):  # gone already: the assertion above says why
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        log.close()
    return found[0].parent


def test_killed_stage_resumes_to_the_weights_of_an_uninterrupted_run(first, project, tmp_path):
    artifacts = tmp_path / "artifacts"
    checkpoint = kill_at_first_checkpoint(project, artifacts)
    killed_at = int(checkpoint.name.removeprefix("step-"))
    print(f"killed after the checkpoint of step {killed_at}")
    assert killed_at < 20
    assert not (checkpoint.parents[1] / "manifest.json").exists()

    resumed = run_pipeline(project / "prefix.yaml", [], project, artifacts)
    assert statuses(resumed) == {"data": "cached", "sft_a": "resumed"}
    assert task_states(resumed.run_id)["sft_a"] == "Resumed"
    # the same digest as the clean run in the module's own artifacts root
    assert Path(stage(resumed, "sft_a").artifact).name == Path(stage(first, "sft_a").artifact).name
    clean, again = weights(first, "sft_a"), weights(resumed, "sft_a")
    assert clean.keys() == again.keys()
    for name, tensor in clean.items():
        assert torch.equal(again[name], tensor), name
    assert stage(resumed, "sft_a").metrics == stage(first, "sft_a").metrics


def test_mlflow_accepts_any_metric_name(tmp_path):
    """A stage may log `pass@1`: MLflow rejects '@', so the key is made valid rather than the run crashing."""
    tracker = Tracker(tmp_path, "keys")
    tracker.start_pipeline("keys", {}, {}, {})
    run = tracker.stage_run("s", {"config": {"k@2": 1}}, {})
    run.log_metrics({"eval/pass@1": 0.5, "odd:name": 1.0}, 3)
    run.finish("ran", {"eval/pass@1": 0.75}, {}, None)
    data = tracker.client.get_run(run.run_id).data
    assert data.metrics == {"eval/pass_at_1": 0.75, "odd_name": 1.0}
    assert data.params == {"config.k_at_2": "1"}
    assert run.curves["eval/pass@1"] == [(3, 0.5)]  # the curves keep the stage's own names


def test_json_summary_writes_null_for_nan():
    report = PipelineReport("r", "m", "p", [StageReport("s", "sft", "resumed", 1.0,
                                                        {"train/loss": math.nan, "steps": 5.0}, None, None)])
    line = json.loads(report.as_json(), parse_constant=lambda c: pytest.fail(f"{c} is not JSON"))
    assert line["stages"][0]["metrics"] == {"train/loss": None, "steps": 5.0}
