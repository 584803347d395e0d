"""`alignflow deploy`: a cron-scheduled deployment of the pipeline flow on a process work pool, read
back from the Prefect server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from prefect import get_client
from prefect.settings import PREFECT_API_URL
import pytest

from alignflow.flows.cli import main

pytestmark = pytest.mark.system

PIPELINE = """
name: nightly-select
stages:
  rows:
    kind: select
    inputs: {dataset: in.jsonl}
    selectors: [dedup]
"""


def read_back(name: str, pool: str):
    with get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name), client.read_work_pool(pool)


def test_deploy_schedules_the_pipeline_on_a_process_pool(tmp_path, monkeypatch, capsys):
    (tmp_path / "in.jsonl").write_text('{"prompt": "1+1"}\n')
    (tmp_path / "nightly.yaml").write_text(PIPELINE)
    monkeypatch.chdir(tmp_path)

    assert main(["deploy", "nightly.yaml", "--cron", "0 3 * * *", "--pool", "alignflow-test"]) == 0
    assert "prefect worker start --pool alignflow-test" in capsys.readouterr().out
    deployment, pool = read_back("alignflow-pipeline/nightly-select", "alignflow-test")
    assert pool.type == "process"
    assert deployment.work_pool_name == "alignflow-test"
    assert [(s.schedule.cron, s.active) for s in deployment.schedules] == [("0 3 * * *", True)]
    # a worker imports the installed package and runs the spec in this project
    assert deployment.entrypoint == "alignflow.flows.pipeline.pipeline_flow"
    assert deployment.parameters == {"pipeline": str(tmp_path / "nightly.yaml"), "project": str(tmp_path)}
    assert deployment.job_variables["working_dir"] == str(tmp_path)

    # deploying again (a new schedule, the pool already there) updates the same deployment
    assert main(["deploy", "nightly.yaml", "--cron", "30 4 * * 1", "--pool", "alignflow-test"]) == 0
    again, _ = read_back("alignflow-pipeline/nightly-select", "alignflow-test")
    assert again.id == deployment.id
    assert [s.schedule.cron for s in again.schedules] == ["30 4 * * 1"]


def test_a_process_worker_runs_the_deployment(tmp_path, monkeypatch):
    """What the README tells users: start a worker on the pool; a flow run of the deployment completes."""
    (tmp_path / "in.jsonl").write_text('{"prompt": "1+1"}\n{"prompt": "1+1"}\n{"prompt": "2+2"}\n')
    (tmp_path / "nightly.yaml").write_text(PIPELINE.replace("nightly-select", "worker-select"))
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "nightly.yaml", "--cron", "0 3 * * *", "--pool", "alignflow-worker"]) == 0
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("alignflow-pipeline/worker-select")
        flow_run = client.create_flow_run_from_deployment(deployment.id)  # due now

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["PREFECT_API_URL"] = PREFECT_API_URL.value()
    worker = subprocess.run([str(Path(sys.executable).with_name("prefect")), "worker", "start", "--pool",
                             "alignflow-worker", "--run-once"], cwd="/", env=env, capture_output=True,
                            text=True, timeout=600)
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run.id).state
    assert state.is_completed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
    manifests = list((tmp_path / "artifacts" / "rows").glob("*/manifest.json"))
    assert len(manifests) == 1
    assert json.loads(manifests[0].read_text())["metrics"]["rows_out"] == 2.0


def test_deploy_rejects_an_invalid_spec_before_touching_the_server(tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.yaml").write_text("name: bad\nstages:\n  s: {kind: nope}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["deploy", "bad.yaml", "--cron", "0 3 * * *", "--pool", "never-created"]) == 1
    assert "stages.s.kind" in capsys.readouterr().err
    with get_client(sync_client=True) as client:
        assert "never-created" not in {p.name for p in client.read_work_pools()}
