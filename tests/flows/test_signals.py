"""`alignflow run` stopped by a real SIGTERM, then by SIGKILL: nothing left running, nothing left RUNNING,
and the rerun resumes from the last checkpoint."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.launch.shutdown import descendants, process_start

pytestmark = pytest.mark.system

PIPELINE = """
name: signals
seed: 0
stages:
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: sft.jsonl}
    algorithm: sft
    settings: {lr: 2.0e-3, max_steps: 60, batch_size: 4, micro_batch_size: 4, max_length: 48,
               save_every: 3, log_every: 3}
"""


@pytest.fixture
def project(tmp_path) -> Path:
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(32)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "p.yaml").write_text(PIPELINE)
    return tmp_path


def start(project: Path) -> subprocess.Popen:
    """The CLI as a user starts it: its own temporary Prefect server (in a home of its own)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PREFECT_API") and k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PREFECT_HOME=str(project / "prefect-home"), OMP_NUM_THREADS="1")
    return subprocess.Popen([str(Path(sys.executable).with_name("alignflow")), "run", "p.yaml"], cwd=project,
                            env=env, stdout=(project / "log.txt").open("a"), stderr=subprocess.STDOUT)


def last_checkpoint(project: Path) -> int:
    """The step of the newest complete checkpoint (older ones are removed), 0 for none."""
    found = project.glob("artifacts/sft/*/checkpoints/step-*/COMPLETE.json")
    return max((int(p.parent.name.removeprefix("step-")) for p in found), default=0)


def wait_for_checkpoint(proc: subprocess.Popen, project: Path, after: int = 0, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while last_checkpoint(project) <= after:
        assert proc.poll() is None, (project / "log.txt").read_text()[-3000:]
        assert time.monotonic() < deadline, "no checkpoint before the timeout"
        time.sleep(0.1)


def wait_gone(pids: dict[int, str | None], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while (alive := [p for p, s in pids.items() if s and process_start(p) == s]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return alive


def states(db: Path, query: str) -> list[tuple]:
    with sqlite3.connect(db) as conn:
        return conn.execute(query).fetchall()


def test_sigterm_then_sigkill_leave_nothing_running_and_the_rerun_resumes(project):
    proc = start(project)
    wait_for_checkpoint(proc, project)
    tree = {p: process_start(p) for p in descendants(proc.pid)}  # Prefect's server, the watchdog
    assert len(tree) >= 2
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    print(f"SIGTERM: exited in {time.monotonic() - began:.1f} s")
    assert wait_gone(tree, 10) == []
    prefect_db = project / "prefect-home" / "prefect.db"
    assert states(prefect_db, "select state_type from flow_run") == [("CRASHED",)]
    assert states(prefect_db, "select name, state_type from task_run") == [("sft", "CRASHED")]
    mlflow_db = project / "mlflow.db"
    assert sorted(states(mlflow_db, "select name, status from runs")) == [("sft", "KILLED"), ("signals", "KILLED")]

    done = last_checkpoint(project)
    proc = start(project)
    wait_for_checkpoint(proc, project, after=done)  # it resumed and went on
    tree = {p: process_start(p) for p in descendants(proc.pid)}
    proc.kill()  # no handler runs: the watchdog stops what it left
    proc.wait()
    assert wait_gone(tree, 15) == []
    running = states(mlflow_db, "select run_uuid from runs where status = 'RUNNING'")
    assert len(running) == 2  # until a later run finds their process gone

    report = run_pipeline(project / "p.yaml", [], project)
    assert {s.name: s.status for s in report.stages} == {"sft": "resumed"}
    with sqlite3.connect(mlflow_db) as conn:  # the killed attempt's runs, closed by this run
        left = conn.execute("select status from runs where run_uuid in (?, ?)", [r[0] for r in running]).fetchall()
    assert left == [("FAILED",), ("FAILED",)]
