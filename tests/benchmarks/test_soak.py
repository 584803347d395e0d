"""benchmarks/soak.py's comparison: final metrics counted and named one by one, not by stage."""

import importlib.util
import json
from pathlib import Path

SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak():
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_final_metrics_are_one_entry_per_stage_metric(tmp_path):
    path = tmp_path / "metrics.json"
    path.write_text(json.dumps({"sft": {"train/loss": 0.5, "steps": 12.0}, "eval": {"accuracy": 0.25}}))
    assert _soak().final_metrics(path) == {"sft.train/loss": 0.5, "sft.steps": 12.0, "eval.accuracy": 0.25}
