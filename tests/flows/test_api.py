"""The Python API (flows/api.py): a pipeline run from a path or a dict gives its stages' statuses,
metrics and artifact folders, as `alignflow run --json` does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from alignflow.core.errors import SpecError
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows import RunOptions, RunResult, run, validate

# a short sft stage and an evaluation of its model on a few test prompts
SPEC = {
    "name": "api-tiny", "seed": 0,
    "stages": {
        "sft": {"kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": "data/sft.jsonl"}, "algorithm": "sft",
                "settings": {"lr": 2.0e-3, "max_steps": 3, "batch_size": 8, "micro_batch_size": 8,
                             "max_length": 96}},
        "eval": {"kind": "evaluate", "inputs": {"model": "stage:sft", "dataset": "data/test.jsonl"},
                 "rewards": ["math_accuracy"],
                 "settings": {"limit": 4, "generation": {"max_new_tokens": 8, "temperature": 0.0}}},
    },
}

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("one_thread")]  # a run starts Prefect and a child


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("api")
    write_datasets(root / "data")
    (root / "tiny.yaml").write_text(yaml.safe_dump(SPEC, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def first(project, prefect_server) -> RunResult:
    return run(project / "tiny.yaml", ["sft.settings.max_steps=2"], project=project, options=RunOptions())


def test_a_run_from_a_path_gives_statuses_metrics_and_artifacts(first, project):
    assert first.ok and first.statuses == {"sft": "ran", "eval": "ran"}
    assert first.metrics["sft"]["steps"] == 2.0  # the override applied
    assert 0.0 <= first.metrics["eval"]["accuracy"] <= 1.0
    model = first.artifacts["sft"] / "out" / "model"
    assert model.is_dir() and first.artifacts["sft"].parent == project / "artifacts" / "sft"
    summary = first.as_dict()  # what `alignflow run --json` prints
    assert [(s["name"], s["status"]) for s in summary["stages"]] == [("sft", "ran"), ("eval", "ran")]
    assert summary["stages"][1]["metrics"] == json.loads(json.dumps(first.metrics["eval"]))


def test_a_dict_pipeline_with_dict_overrides_lands_on_the_same_artifacts(first, project):
    again = run(SPEC, {"sft.settings.max_steps": 2}, project=project, options=RunOptions())
    assert again.statuses == {"sft": "cached", "eval": "cached"}
    assert again.artifacts == first.artifacts and again.metrics == first.metrics


def test_validate_takes_a_dict_and_names_the_problem(project):
    assert list(validate(SPEC, project=project).stages) == ["sft", "eval"]
    with pytest.raises(SpecError, match="max_steps"):
        validate(SPEC, {"sft.settings.max_steps": "many"}, project=project)
