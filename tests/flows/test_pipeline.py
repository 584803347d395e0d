import json
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from alignflow.core import Selector, hookimpl
from alignflow.core.plugins import get_plugins
from alignflow.flows.cli import main
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.tracking import tracking_uri
from reports import statuses

pytestmark = pytest.mark.system


@pytest.fixture(scope="module")
def project(tmp_path_factory, make_project):
    return make_project(tmp_path_factory.mktemp("proj"))


@pytest.fixture(scope="module")
def first(project, prefect_server):
    return run_pipeline(project / "chain.yaml", [], project)


def rows(report, stage: str) -> list[dict]:
    line = next(s for s in report.stages if s.name == stage)
    return [json.loads(x) for x in (Path(line.artifact) / "out" / "data.jsonl").open()]


def test_first_run_runs_every_stage_with_correct_outputs(first):
    assert statuses(first) == {"a": "ran", "b": "ran", "c": "ran", "d": "ran"}
    prompts = [r["prompt"] for r in rows(first, "a")]
    assert prompts == ["1+1", "2+2", "3+3", "4+4", "5+5", "6+6", "7+7", "8+8"]
    assert len(rows(first, "b")) == 5
    assert all(r["level"] in (1, 2) for r in rows(first, "c"))
    assert [r["level"] for r in rows(first, "d")] == [3] * len(rows(first, "d"))
    b = next(s for s in first.stages if s.name == "b")
    assert b.metrics == {"rows_in": 8.0, "rows_out": 5.0, "kept_fraction": 5 / 8}


def test_rerun_is_all_cached_and_fast(first, project):
    again = run_pipeline(project / "chain.yaml", [], project)
    print(f"cached rerun: {again.seconds:.2f} s inside the flow")
    assert statuses(again) == {"a": "cached", "b": "cached", "c": "cached", "d": "cached"}
    assert again.seconds < 15
    assert [s.artifact for s in again.stages] == [s.artifact for s in first.stages]
    assert [s.metrics for s in again.stages] == [s.metrics for s in first.stages]


def test_config_change_reruns_the_stage_and_its_descendants_only(first, project):
    changed = run_pipeline(project / "chain.yaml", ["b.selectors.0.config.n=4"], project)
    assert statuses(changed) == {"a": "cached", "b": "ran", "c": "ran", "d": "cached"}
    before = {s.name: s.artifact for s in first.stages}
    after = {s.name: s.artifact for s in changed.stages}
    assert [n for n in before if before[n] != after[n]] == ["b", "c"]
    assert len(rows(changed, "b")) == 4


def test_failing_stage_stops_descendants_not_siblings(first, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    code = main(["run", "chain.yaml", "--json", "--set", "b.selectors.0.name=column_filter",
                 "--set", "b.selectors.0.config={column: split, equals: train}"])
    out = capsys.readouterr()
    assert code == 1
    summary = json.loads(out.out.strip().splitlines()[-1])
    assert set(summary) == {"run_id", "mlflow_run_id", "stages"}
    assert all(set(s) == {"name", "kind", "status", "seconds", "metrics"} for s in summary["stages"])
    assert {s["name"]: s["status"] for s in summary["stages"]} == {
        "a": "cached", "b": "failed", "c": "skipped", "d": "cached"}
    assert "split: missing" in out.err  # the error is in the summary table


def test_a_stage_that_writes_no_rows_fails_and_is_not_cached(first, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    empty = ["--set", "d.selectors.0.config.equals=9"]  # no row has level 9
    for _ in range(2):  # the failure is not cached: the second run fails the same way
        assert main(["run", "chain.yaml", "--json", *empty]) == 1
        out = capsys.readouterr()
        summary = json.loads(out.out.strip().splitlines()[-1])
        assert {s["name"]: s["status"] for s in summary["stages"]}["d"] == "failed"
        assert "wrote no rows" in out.err and "allow_empty" in out.err
    assert main(["run", "chain.yaml", "--json", *empty, "--set", "d.settings.allow_empty=true"]) == 0


def test_mlflow_parent_run_with_a_nested_run_per_stage(first, project):
    client = MlflowClient(tracking_uri(project))
    parent = client.get_run(first.mlflow_run_id)
    assert parent.data.tags["prefect.flow_run_id"] == first.run_id
    assert parent.data.params["seed"] == "3"
    assert {f.path for f in client.list_artifacts(parent.info.run_id)} >= {"spec.yaml"}
    children = client.search_runs([parent.info.experiment_id],
                                  f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    by_stage = {r.data.tags["alignflow.stage"]: r for r in children}
    assert set(by_stage) == {"a", "b", "c", "d"}
    b = by_stage["b"]
    assert b.data.tags["alignflow.digest"] == first.stages[1].artifact.rsplit("/", 1)[-1]
    assert b.data.params["selectors.0.config.n"] == "5"
    assert [m.value for m in client.get_metric_history(b.info.run_id, "rows")] == [8.0, 5.0]
    artifacts = {f.path for f in client.list_artifacts(b.info.run_id)}
    assert {"manifest.json", "plots"} <= artifacts


class Exploding:
    """A third-party selector whose code raises."""

    @staticmethod
    @hookimpl
    def register_selectors(register):
        class Explode(Selector):
            def __call__(self, rows, rng):
                return [row["no_such_column"] for row in rows]

        register("explode", Explode)


def test_a_plugin_that_raises_is_named_with_its_distribution(first, project, monkeypatch, capsys):
    plugins = get_plugins()
    plugins.add(Exploding, "exploding", "thirdparty-selectors", "1.2")
    monkeypatch.chdir(project)
    try:
        code = main(["run", "chain.yaml", "--set", "d.selectors.0={name: explode}"])
    finally:
        plugins.remove("exploding")
    captured = capsys.readouterr()
    err = " ".join((captured.out + captured.err).replace("│", " ").split())
    assert code == 1
    assert "selector 'explode' (thirdparty-selectors 1.2): KeyError" in err, err[-2000:]


def test_the_summary_fits_a_terminal(first, project, monkeypatch):
    from rich.console import Console

    monkeypatch.chdir(project)
    console = Console(width=80, record=True, force_terminal=False)
    first.render(console)
    text = console.export_text()
    rows = [line for line in text.splitlines() if line.split()[:1] in (["a"], ["b"], ["c"], ["d"])]
    assert len(rows) == len(first.stages)  # a table line per stage, not folded
    assert all(len(line) <= 80 for line in text.splitlines())
    assert f"  a: artifacts/a/{Path(first.stages[0].artifact).name}" in text
