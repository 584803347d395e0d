"""Stages on Prefect work pools, end to end on a real Prefect server with two process work pools: the
select stage runs on pool `cpu`, the sft stage on pool `train`, each taken by real `prefect worker start`
processes. A train worker killed mid-stage with its flow run (a machine gone) leaves checkpoints and
stops heartbeating; the pipeline sets its flow run Crashed and fails the stage by name. The next run,
`alignflow run` on a new worker, is stopped by SIGINT mid-stage: it cancels the stage's flow run, whose
process the worker stops, and reports it Cancelled. The run after that, on the same worker, resumes the
stage to the weights of an uninterrupted run in the pipeline's own process; a rerun is all cached; a
pool without a worker fails its stage after the timeout. The three runs and the workers are set up once
for the module (`runs`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from prefect import get_client
from prefect.client.schemas.filters import DeploymentFilter
from prefect.settings import PREFECT_API_URL
from safetensors.torch import load_file

from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.launch.shutdown import CANCEL_WAIT_S, descendants, process_start, stop_processes
from alignflow.flows.tracking import tracking_uri
from reports import statuses

HEARTBEAT_S = 2  # workers heartbeat each 2 s (Prefect's default: 30), so a dead one is told in ~8 s

# sft saves every 2 of its 40 steps: the worker is killed after the first checkpoint, the pipeline stopped
# after the next one, each with steps to spare so that neither lands after the stage finished (with 10 steps,
# on a loaded machine the stage once finished in the seconds the cancellation took to reach the worker).
STEPS = 40
PIPELINE = """
name: pools
seed: 0
pools: {select: cpu, sft: train}
stages:
  data:
    kind: select
    inputs: {dataset: data/sft.jsonl}
    selectors: [{name: subsample, config: {n: 64}}]
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: "stage:data"}
    algorithm: sft
    settings: {lr: 2.0e-3, max_steps: 40, batch_size: 8, micro_batch_size: 8, max_length: 96,
               save_every: 2, log_every: 2}
"""


def stage(report, name: str):
    return next(s for s in report.stages if s.name == name)


def weights(report, name: str) -> dict[str, torch.Tensor]:
    return load_file(Path(stage(report, name).artifact) / "out" / "model" / "model.safetensors")


def env() -> dict[str, str]:
    """The harness's server, one thread, and not this process's torch.distributed rank."""
    out = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    out.update(PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1",
               PREFECT_WORKER_QUERY_SECONDS="1",  # a worker polls each second, not each 10
               PREFECT_WORKER_HEARTBEAT_SECONDS=str(HEARTBEAT_S))
    return out


@contextlib.contextmanager
def worker(pool: str, log: Path):
    """`prefect worker start --pool POOL` in its own session; stopped with its flow runs at the end."""
    with log.open("a") as out:
        proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool",
                                 pool, "--type", "process"], cwd="/", env=env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        yield proc
    finally:
        stop_processes(descendants(proc.pid) + [proc.pid], grace=2.0)
        proc.wait()


def stage_runs(pool: str) -> list:
    """The flow runs of the stage deployment on `pool`, oldest first."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(deployment_filter=DeploymentFilter(name={"any_": [pool]}))
    return sorted(runs, key=lambda r: r.created)


pytestmark = [pytest.mark.system, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pools")
    write_datasets(root / "data")
    (root / "pipeline.yaml").write_text(PIPELINE)
    # every stage in the pipeline's process
    (root / "here.yaml").write_text(PIPELINE.replace("pools: {select: cpu, sft: train}\n", ""))
    return root


@pytest.fixture(scope="module")
def cpu_worker(prefect_server, project):
    """One worker of pool `cpu`, for the data stages, for the whole module (on the suite's server: its address is
    set only once that server started)."""
    with worker("cpu", project / "worker-cpu.log") as proc:
        yield proc


def checkpoints(artifacts: Path) -> list[Path]:
    """sft's complete checkpoints, oldest first."""
    return sorted(p.parent for p in artifacts.glob("sft/*/checkpoints/step-*/COMPLETE.json"))


def step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.removeprefix("step-"))


def kill_at_first_checkpoint(worker_proc, artifacts: Path, killed: dict) -> None:
    """SIGKILL the worker and its flow run (a machine gone) once sft has a checkpoint; nothing else: the
    pipeline must itself tell that the worker is gone and fail the stage."""
    deadline = time.monotonic() + 600
    while not (found := checkpoints(artifacts)):
        if time.monotonic() > deadline:
            return
        time.sleep(0.05)
    for pid in descendants(worker_proc.pid) + [worker_proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    killed["checkpoint"] = found[0]
    killed["finished"] = (found[0].parents[1] / "manifest.json").exists()
    killed["at"] = time.monotonic()


def interrupt_after(step: int, worker_proc, project: Path) -> dict:
    """`alignflow run pipeline.yaml`, sent SIGINT (Ctrl-C) once sft, running on the worker, has a checkpoint
    past `step`. Returns its exit code, output, the checkpoint, and whether the flow run's processes
    were gone when it exited."""
    log = project / "interrupted.log"
    with log.open("w") as out:
        run = subprocess.Popen([str(Path(sys.executable).with_name("alignflow")), "run", "pipeline.yaml"],
                               cwd=project, env=env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 600
    while not (newer := [c for c in checkpoints(project / "artifacts") if step_of(c) > step]):
        assert run.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.05)
    flow_run = {pid: process_start(pid) for pid in descendants(worker_proc.pid)}  # `python -m prefect.engine`
    sent = time.monotonic()
    run.send_signal(signal.SIGINT)
    code = run.wait(120)
    return {"code": code, "seconds": time.monotonic() - sent, "log": log.read_text(), "checkpoint": newer[0],
            "flow_run": flow_run, "gone": all(process_start(p) != start for p, start in flow_run.items()),
            "finished": (newer[0].parents[1] / "manifest.json").exists(),  # once it was Cancelled
            "newest": checkpoints(project / "artifacts")[-1]}


@pytest.fixture(scope="module")
def runs(project, cpu_worker):
    """The pipeline with its train worker killed mid-stage; then `alignflow run` on a new train worker,
    stopped by SIGINT mid-stage; then again on that worker, to the end."""
    killed = {}
    with worker("train", project / "worker-1.log") as proc:
        watcher = threading.Thread(target=kill_at_first_checkpoint,
                                   args=(proc, project / "artifacts", killed), daemon=True)
        watcher.start()
        first = run_pipeline(project / "pipeline.yaml", [], project)
        killed["noticed_s"] = time.monotonic() - killed.get("at", float("nan"))
        watcher.join()
    with worker("train", project / "worker-2.log") as proc:
        stopped = interrupt_after(step_of(killed["checkpoint"]), proc, project)
        stopped["worker_alive"] = proc.poll() is None
        last = run_pipeline(project / "pipeline.yaml", [], project)
    print(f"killed run: {first.seconds:.1f} s (failed {killed['noticed_s']:.1f} s after the kill), "
          f"stopped run: Cancelled {stopped['seconds']:.1f} s after SIGINT, resumed run: {last.seconds:.1f} s")
    return first, last, killed, stopped


def test_a_dead_worker_crashes_its_flow_run_and_fails_its_stage_by_name(runs):
    first, _, killed, _ = runs
    assert statuses(first) == {"data": "ran", "sft": "failed"}
    error = stage(first, "sft").error
    assert error.startswith("stage 'sft' on work pool 'train': flow run pools.sft"), error
    assert "Crashed: worker 'ProcessWorker " in error and "of work pool 'train' sent no heartbeat for" in error
    assert f"(it beats every {HEARTBEAT_S} s): its machine or process is gone" in error
    # told after 3 missed beats (x 1.3 jitter: 7.8 s) and a poll, not at once, not never
    assert 3 * HEARTBEAT_S < killed["noticed_s"] < 60, killed["noticed_s"]
    assert step_of(killed["checkpoint"]) < STEPS  # mid-stage
    assert not killed["finished"]


def test_stopping_the_pipeline_cancels_its_stage_on_the_worker(runs):
    *_, stopped = runs
    assert stopped["code"] == 128 + signal.SIGINT, stopped["log"][-3000:]
    # Cancelled through Prefect (the worker stopped the flow run's process), reported, and not given up on
    assert re.search(r"stage 'sft' on work pool 'train': flow run pools\.sft \([0-9a-f-]{36}\): Cancelled\n",
                     stopped["log"]), stopped["log"][-3000:]
    assert stopped["seconds"] < CANCEL_WAIT_S
    assert stopped["flow_run"] and stopped["gone"]  # the flow run's process, gone by the time it was reported
    assert stopped["worker_alive"]  # the worker lives on, and runs the next run's stage
    # stopped mid-stage: its checkpoints kept, nothing published
    assert step_of(stopped["newest"]) < STEPS and not stopped["finished"]


def test_the_next_run_resumes_the_stage_on_a_new_worker(runs, project):
    _, second, _, stopped = runs
    assert statuses(second) == {"data": "cached", "sft": "resumed"}, [s.error for s in second.stages]
    assert stage(second, "sft").metrics["steps"] == float(STEPS)
    assert [(r.name, r.state.name) for r in stage_runs("train")] == [("pools.sft", "Crashed"),
                                                                     ("pools.sft", "Cancelled"),
                                                                     ("pools.sft", "Resumed")]
    # both pools ran stages: the data stage on `cpu` once, cached the second time (never sent again)
    assert [(r.name, r.state.name) for r in stage_runs("cpu")] == [("pools.data", "Completed")]
    # the worker's flow run ran the stage: the MLflow run its manifest names is nested under the
    # pipeline's run and was opened by the worker's process, not this one
    from mlflow.tracking import MlflowClient

    manifest = json.loads((Path(stage(second, "sft").artifact) / "manifest.json").read_text())
    run = MlflowClient(tracking_uri(project)).get_run(manifest["mlflow_run_id"])
    assert run.data.tags["mlflow.parentRunId"] == second.mlflow_run_id
    assert run.data.tags["alignflow.status"] == "resumed"
    assert run.data.tags["alignflow.pid"] != str(os.getpid())
    assert run.data.metrics["steps"] == float(STEPS)
    # the cancelled flow run's stage run was closed by its process as it stopped, not left RUNNING
    cancelled = MlflowClient(tracking_uri(project)).search_runs(
        [run.info.experiment_id], filter_string="tags.`alignflow.stage` = 'sft' and attributes.status = 'KILLED'")
    assert [r.data.tags["alignflow.status"] for r in cancelled] == ["killed"]


def test_a_rerun_is_all_cached_without_a_worker(runs, project):
    _, second, _, _ = runs
    again = run_pipeline(project / "pipeline.yaml", [], project)
    assert statuses(again) == {"data": "cached", "sft": "cached"}
    assert [s.artifact for s in again.stages] == [s.artifact for s in second.stages]
    assert len(stage_runs("train")) == 3 and len(stage_runs("cpu")) == 1  # a finished stage is never sent


def test_the_stage_run_here_lands_on_the_same_digest_and_weights(runs, project, tmp_path):
    _, second, _, _ = runs
    here = run_pipeline(project / "here.yaml", [], project, tmp_path / "artifacts")
    assert statuses(here) == {"data": "ran", "sft": "ran"}
    # where a stage runs is not part of its digest; resumed on a worker = trained here, uninterrupted
    assert Path(stage(here, "sft").artifact).name == Path(stage(second, "sft").artifact).name
    clean, resumed = weights(here, "sft"), weights(second, "sft")
    assert clean.keys() == resumed.keys()
    for name, tensor in clean.items():
        assert torch.equal(resumed[name], tensor), name


def test_a_pool_without_a_worker_fails_its_stage_after_the_timeout(project, tmp_path, monkeypatch):
    monkeypatch.setenv("ALIGNFLOW_POOL_TIMEOUT", "3")  # data runs here: no 3 s race for the cpu worker
    started = time.monotonic()
    report = run_pipeline(project / "here.yaml", ["sft.pool=nobody"], project, tmp_path / "artifacts")
    assert statuses(report) == {"data": "ran", "sft": "failed"}
    error = stage(report, "sft").error
    assert "no worker of work pool 'nobody'" in error and "within 3 s" in error, error
    assert "prefect worker start --pool nobody" in error
    assert time.monotonic() - started < 60
    assert [r.state.name for r in stage_runs("nobody")] == ["Cancelled"]  # not left for a later worker


def test_a_worker_that_heartbeats_is_never_judged_gone_and_a_silent_one_is_after_three_beats():
    from types import SimpleNamespace

    from alignflow.flows.launch.pools import WorkerWatch

    pool = {"w1": SimpleNamespace(name="w1", last_heartbeat_time=0, heartbeat_interval_seconds=10)}
    client = SimpleNamespace(read_workers_for_work_pool=lambda name: list(pool.values()))
    now = [0.0]
    watch = WorkerWatch("train", clock=lambda: now[0])
    run = SimpleNamespace(labels={"prefect.worker.name": "w1"})
    assert watch.gone(client, SimpleNamespace(labels={})) is None  # no worker has taken it yet
    for beat in range(1, 1000):  # a stage of ~3 hours whose worker beats each 10 s
        now[0] += 10.0
        pool["w1"].last_heartbeat_time = beat
        assert watch.gone(client, run) is None
    # silent: gone once 3 beats x 1.3 (jitter) x 10 s = 39 s pass without a new heartbeat
    now[0] += 39.0
    assert watch.gone(client, run) is None
    now[0] += 1.0
    assert watch.gone(client, run) == ("worker 'w1' of work pool 'train' sent no heartbeat for 40 s "
                                       "(it beats every 10 s): its machine or process is gone")
    del pool["w1"]  # a worker the pool no longer lists: gone after as long, counted from then
    now[0] += 10.0
    assert watch.gone(client, run) is None
    now[0] += 40.0
    assert "worker 'w1' of work pool 'train' is no longer registered" in watch.gone(client, run)


def test_a_stage_pool_overrides_the_pipeline_map_and_names_are_checked(monkeypatch):
    from alignflow.core.errors import SpecError
    from alignflow.core.spec.schema import parse_spec
    from alignflow.flows.options import RunOptions

    rows = {"kind": "select", "inputs": {"dataset": "in.jsonl"}, "selectors": ["dedup"]}
    spec = parse_spec({"name": "p", "pools": {"select": "cpu"}, "stages": {
        "a": rows, "b": {**rows, "pool": "gpu-1"}, "c": {**rows, "kind": "select"}}}, "p.yaml")
    assert {n: spec.pool_of(n) for n in spec.stages} == {"a": "cpu", "b": "gpu-1", "c": "cpu"}
    assert parse_spec({"name": "p", "stages": {"a": rows}}).pool_of("a") is None  # the pipeline's process
    with pytest.raises(SpecError, match=r"p.yaml: stages.a.pool: .*'gpu/1' is not a work pool name"):
        parse_spec({"name": "p", "stages": {"a": {**rows, "pool": "gpu/1"}}}, "p.yaml")
    with pytest.raises(SpecError, match=r"p.yaml: pools.train.\[key\]: Input should be 'select'"):
        parse_spec({"name": "p", "pools": {"train": "gpu"}, "stages": {"a": rows}}, "p.yaml")
    assert RunOptions.from_env({}).pool_timeout_s == 600
    with pytest.raises(SpecError, match="ALIGNFLOW_POOL_TIMEOUT='0': expected a whole number of seconds"):
        RunOptions.from_env({"ALIGNFLOW_POOL_TIMEOUT": "0"})


def test_deploy_creates_the_stage_deployment_on_each_pool_the_spec_names(tmp_path, monkeypatch, capsys):
    from alignflow.flows.cli import main

    (tmp_path / "in.jsonl").write_text('{"prompt": "1+1"}\n')
    (tmp_path / "p.yaml").write_text("name: deploy-pools\npools: {select: cpu}\nstages:\n  rows:\n"
                                     "    kind: select\n    inputs: {dataset: in.jsonl}\n    selectors: [dedup]\n")
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "p.yaml", "--cron", "0 3 * * *", "--pool", "pipelines"]) == 0
    assert "prefect worker start --pool cpu" in capsys.readouterr().out
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("alignflow-stage/cpu")
        assert client.read_work_pool("cpu").type == "process"
    assert deployment.entrypoint == "alignflow.flows.launch.pools.stage_flow"  # the installed package: no code storage
    assert deployment.work_pool_name == "cpu" and not deployment.schedules  # started by the pipeline's runs
