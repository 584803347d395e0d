"""Two `alignflow run`s started at once on one fresh PREFECT_HOME, beside two busy loops per core: each starts
Prefect's temporary server on the same SQLite database, one after the other, and neither server fails."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.system

ALIGNFLOW = str(Path(sys.executable).parent / "alignflow")


def test_two_runs_at_once_on_one_prefect_home_under_load(tmp_path, make_project):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}  # no server given: each starts one
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), OMP_NUM_THREADS="1")
    projects = [make_project(tmp_path / f"p{i}") for i in range(2)]
    loops = [subprocess.Popen(["bash", "-c", "while :; do :; done"]) for _ in range(2 * (os.cpu_count() or 1))]
    try:
        runs = [subprocess.Popen([ALIGNFLOW, "run", "chain.yaml"], cwd=p, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for p in projects]
        outs = [run.communicate(timeout=900)[0] for run in runs]
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    for run, out in zip(runs, outs):
        assert run.returncode == 0, out[-3000:]
        assert "database is locked" not in out, out[-3000:]
        # a server that quit at startup (a migration raced) is started again by Prefect: the run still passes
        assert "Application startup failed" not in out and out.count("Starting temporary server") == 1, out[-3000:]
    assert [len(list(p.glob("artifacts/c/*/manifest.json"))) for p in projects] == [1, 1]  # the whole chain
    assert (tmp_path / "prefect-home" / "prefect.db").is_file()  # on the one database
