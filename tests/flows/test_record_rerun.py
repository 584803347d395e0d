"""`alignflow reproduce RECORD`: a committed run record's seed band judges a rerun of one of its seeds."""

from __future__ import annotations

import json

import pytest

from alignflow.core.fingerprint import NUMERICS
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.cli import main
from alignflow.flows.records import band_interval, check_record, manifests
from alignflow.flows.pipeline import run_pipeline

PIPELINE = """
name: records
seed: 3
stages:
  rl_sample:
    kind: select
    inputs: {dataset: data/rl.jsonl}
    selectors: [dedup, {name: subsample, config: {n: 64}}]
"""

pytestmark = [pytest.mark.system]


def test_the_band_is_two_standard_deviations_and_holds_every_recorded_value():
    band = {"mean": 0.5, "se": 0.1 / 3 ** 0.5, "values": [0.4, 0.5, 0.6]}  # sd 0.1
    assert band_interval(band) == pytest.approx((0.3, 0.7))
    assert band_interval({"mean": 2.0, "se": None, "values": [2.0]}) == (2.0, 2.0)
    assert band_interval({"mean": 0.5, "se": 0.001, "values": [0.2, 0.5, 0.8]}) == (0.2, 0.8)


def record(root, stages, rows_band, seed=3, numerics=NUMERICS):
    """A record as benchmarks/seed_band.py writes it, from a run's manifests, with the band `rows_band`."""
    return {"pipeline": "records.yaml", "command": "alignflow run records.yaml --set seed=SEED", "numerics": numerics,
            "seeds": {str(seed): {name: {k: m[k] for k in ("digest", "seed", "fingerprint", "metrics")}
                                  for name, m in stages.items()}},
            "bands": {"rl_sample": {"rows_out": rows_band}}}


def test_a_rerun_inside_the_band_passes_outside_fails_and_elsewhere_says_so(tmp_path, monkeypatch, capsys):
    write_datasets(tmp_path / "data")
    (tmp_path / "records.yaml").write_text(PIPELINE)
    artifacts = tmp_path / "artifacts"
    first = run_pipeline(tmp_path / "records.yaml", ["seed=3"], tmp_path, artifacts=artifacts)
    assert first.stages[0].metrics["rows_out"] == 64.0
    stages = manifests(artifacts)
    path = tmp_path / "record.json"

    path.write_text(json.dumps(record(tmp_path, stages, {"mean": 63.0, "se": 1.0, "values": [62.0, 63.0, 64.0]})))
    monkeypatch.chdir(tmp_path)
    assert main(["reproduce", str(path)]) == 0, capsys.readouterr().out
    assert "seed 3: every metric inside the record's band" in capsys.readouterr().out

    path.write_text(json.dumps(record(tmp_path, stages, {"mean": 80.0, "se": 1.0, "values": [79.0, 80.0, 81.0]})))
    done = check_record(path, tmp_path, artifacts=artifacts)  # the same root: the stage is cached, not rerun
    spread = 2 * 3 ** 0.5  # 2 sample standard deviations: se 1 over 3 seeds
    assert done.code == 1 and done.outside == {"rl_sample.rows_out": (64.0, 80 - spread, 80 + spread)}
    assert not done.environment

    moved = {name: {**m, "fingerprint": {**m["fingerprint"], "torch": "0.0"}} for name, m in stages.items()}
    path.write_text(json.dumps(record(tmp_path, moved, {"mean": 80.0, "se": 1.0, "values": [79.0, 80.0, 81.0]})))
    done = check_record(path, tmp_path, artifacts=artifacts)
    assert done.code == 3 and list(done.environment) == ["rl_sample: torch"]

    # a record of an earlier numerics epoch: its band is the old code's, so outside it is "elsewhere", said why
    path.write_text(json.dumps(record(tmp_path, stages, {"mean": 80.0, "se": 1.0, "values": [79.0, 80.0, 81.0]},
                                      numerics=NUMERICS - 1)))
    done = check_record(path, tmp_path, artifacts=artifacts)
    assert done.code == 3 and done.environment == {"numerics": (NUMERICS - 1, NUMERICS)}
