import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from alignflow.core.spec.schema import parse_spec
from alignflow.flows.data import BUNDLED, RECIPE_DATA, ensure_data, needs_data, regenerate_data
from alignflow.flows.digest import data_version

pytestmark = pytest.mark.system

REPO = Path(__file__).resolve().parents[2]


def dvc(cwd: Path, *args: str) -> str:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout


def test_regenerated_data_matches_the_committed_data_dvc(tmp_path):
    """`alignflow data` is byte-identical: DVC's own hash of every dataset under data/ (the bundled task's and each
    recipe's folder) equals the committed data.dvc; every file a shipped pipeline reads there is among them."""
    dvc(tmp_path, "init", "--no-scm", "-q")
    written = regenerate_data(tmp_path)
    assert {name.split("/")[0] for name in written if "/" in name} == set(RECIPE_DATA)
    for pipeline in (REPO / "pipelines").glob("*.yaml"):
        spec = parse_spec(yaml.safe_load(pipeline.read_text()))
        read = {v for s in spec.stages.values() for v in s.inputs.values() if v.startswith("data/")}
        assert {v for v in read if not (tmp_path / v).is_file()} == set(), pipeline.name
    dvc(tmp_path, "add", "data", "-q")
    assert data_version(tmp_path) == data_version(REPO)
    status = dvc(tmp_path, "status", "data.dvc")
    assert "up to date" in status, status


def test_only_the_folders_a_stage_reads_from_and_misses_are_regenerated(tmp_path):
    spec = parse_spec({"name": "p", "stages": {
        "s": {"kind": "select", "inputs": {"dataset": "data/rl.jsonl"}, "selectors": ["dedup"]},
        "t": {"kind": "select", "inputs": {"dataset": "data/tool-use/rl.jsonl"}, "selectors": ["dedup"]}}})
    assert needs_data(spec, tmp_path) == {BUNDLED, "tool-use"}
    regenerate_data(tmp_path, folders={"tool-use"})
    assert needs_data(spec, tmp_path) == {BUNDLED}
    ensure_data(spec, tmp_path)
    assert not needs_data(spec, tmp_path)
    assert sorted(p.name for p in (tmp_path / "data").iterdir() if p.is_dir()) == ["tool-use"]  # not the others
