"""Prefect's temporary server started by one process at a time per SQLite database: two `alignflow run`s started at
once on one fresh PREFECT_HOME, beside a busy loop per core, each start it on the same database, one after the
other, and neither server fails."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prefect.server.api.server import SubprocessASGIServer

from alignflow.flows import prefect_server
from helpers.load import busy_loops

ALIGNFLOW = str(Path(sys.executable).parent / "alignflow")


def test_the_server_starts_while_the_lock_beside_its_database_is_held(tmp_path, monkeypatch):
    db = tmp_path / "prefect.db"
    monkeypatch.setattr(prefect_server, "sqlite_database", lambda: db)
    held = []

    def start(self):  # another open file tries the lock: it must be taken
        with open(tmp_path / "prefect.db.start.lock", "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held.append(False)
            except BlockingIOError:
                held.append(True)

    monkeypatch.setattr(SubprocessASGIServer, "start", start)
    prefect_server.start_temporary_server()
    assert held == [True]


# one stage: the race is in the servers' start, not in the stages a run then records
ONE_STAGE = """
name: one
seed: 3
stages:
  a:
    kind: select
    inputs: {dataset: in.jsonl}
    selectors: [dedup]
"""


@pytest.mark.system
@pytest.mark.xdist_group("load")  # the busy loops load the whole machine: one such test at a time
def test_two_runs_at_once_on_one_prefect_home_under_load(tmp_path, make_project):
    """Proves: two `alignflow run`s started at once on one fresh PREFECT_HOME, under load, each start their
    temporary server on the one database, one after the other; neither fails ("database is locked", a migration
    raced at startup) and both pipelines finish."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # no server given: each starts one
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), OMP_NUM_THREADS="1")
    projects = [make_project(tmp_path / f"p{i}") for i in range(2)]
    for p in projects:
        (p / "one.yaml").write_text(ONE_STAGE)
    # a loop per core keeps both starts slow and overlapping (the lock itself is proved by the test above); two
    # per core made this the suite's slowest test (210 s) and starved the other worker's tests while it ran
    with busy_loops(os.cpu_count() or 1):
        runs = [subprocess.Popen([ALIGNFLOW, "run", "one.yaml"], cwd=p, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for p in projects]
        outs = [run.communicate(timeout=900)[0] for run in runs]
    for run, out in zip(runs, outs):
        assert run.returncode == 0, out[-3000:]
        assert "database is locked" not in out, out[-3000:]
        # a server that quit at startup (a migration raced) is started again by Prefect: the run still passes
        assert "Application startup failed" not in out and out.count("Starting temporary server") == 1, out[-3000:]
    assert [len(list(p.glob("artifacts/a/*/manifest.json"))) for p in projects] == [1, 1]  # the stage finished
    assert (tmp_path / "prefect-home" / "prefect.db").is_file()  # on the one database
