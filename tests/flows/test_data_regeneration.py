import subprocess
import sys
from pathlib import Path

import pytest

from alignflow.core.spec.schema import parse_spec
from alignflow.flows.data import needs_data, regenerate_data
from alignflow.flows.digest import data_version

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]


def dvc(cwd: Path, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_regenerated_data_matches_the_committed_data_dvc(tmp_path):
    """`alignflow data` is byte-identical: DVC's own hash of it equals the committed data.dvc."""
    dvc(tmp_path, "init", "--no-scm", "-q")
    regenerate_data(tmp_path)
    dvc(tmp_path, "add", "data", "-q")
    assert data_version(tmp_path) == data_version(REPO)
    status = dvc(tmp_path, "status", "data.dvc")
    assert "up to date" in status, status


def test_needs_data_only_when_a_stage_reads_missing_data(tmp_path):
    spec = parse_spec({"name": "p", "stages": {"s": {"kind": "select", "inputs": {"dataset": "data/rl.jsonl"},
                                                     "selectors": ["dedup"]}}})
    assert needs_data(spec, tmp_path)
    regenerate_data(tmp_path)
    assert not needs_data(spec, tmp_path)
