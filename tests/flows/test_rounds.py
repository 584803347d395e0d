"""Loops end to end: a three-round pipeline on Prefect's server, MLflow's SQLite store and the artifact store;
a rerun is all cached, `repeat: 4` runs round 4 alone, MLflow's runs carry the round, `validate` shows it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import load_spec
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.plan import plan_pipeline
from alignflow.flows.reproduce import reproduce
from alignflow.flows.tracking import tracking_uri
from reports import statuses

ALIGNFLOW = str(Path(sys.executable).parent / "alignflow")

# Each round draws 4 prompts and trains one SGD step from the previous round's model (round 1: the tiny
# model); `last` reads the last round's draw.
PIPELINE = """
name: rounds
seed: 5
stages:
  prompts:
    kind: select
    inputs: {dataset: in.jsonl}
    selectors: [dedup]
  grow:
    repeat: 3
    first: {train: "builtin:tiny"}
    stages:
      draw:  # the same input and config every round: the round's seed alone draws another subset
        kind: select
        inputs: {dataset: "stage:prompts"}
        selectors: [{name: subsample, config: {n: 4}}]
      train:
        kind: sft
        inputs: {model: "stage:train@prev", dataset: "stage:draw"}
        algorithm: sft
        settings: {lr: 1.0e-2, optimizer: sgd, max_steps: 1, batch_size: 4, micro_batch_size: 4,
                   max_length: 16, log_every: 1}
  last:
    kind: select
    inputs: {dataset: "stage:grow.draw"}
    selectors: [dedup]
"""
DRAWS = """
name: draws
seed: 5
stages:
  prompts: {kind: select, inputs: {dataset: in.jsonl}, selectors: [dedup]}
  grow:
    repeat: 3
    stages:
      draw: {kind: select, inputs: {dataset: "stage:prompts"}, selectors: [{name: subsample, config: {n: 4}}]}
  last: {kind: select, inputs: {dataset: "stage:grow.draw"}, selectors: [dedup]}
"""
ROUND_3 = ["prompts", "draw.r1", "train.r1", "draw.r2", "train.r2", "draw.r3", "train.r3", "last"]

pytestmark = [pytest.mark.system, pytest.mark.usefixtures("one_thread")]


def manifest(report, name: str) -> dict:
    line = next(s for s in report.stages if s.name == name)
    return json.loads((Path(line.artifact) / "manifest.json").read_text())


def rows(report, name: str) -> list[str]:
    line = next(s for s in report.stages if s.name == name)
    return [json.loads(x)["prompt"] for x in (Path(line.artifact) / "out" / "data.jsonl").open()]


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rounds")
    lines = [{"prompt": f"{a}+{b}=", "completion": str(a + b)} for a in range(3) for b in range(4)]
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (root / "rounds.yaml").write_text(PIPELINE)
    return root


@pytest.fixture(scope="module")
def first(project, prefect_server):
    report = run_pipeline(project / "rounds.yaml", [], project)
    print(f"three rounds: {report.seconds:.1f} s inside the flow")
    return report


def test_three_rounds_run_each_reading_the_previous_round(first):
    assert statuses(first) == {name: "ran" for name in ROUND_3}
    names = [s.name for s in first.stages]  # dependency order
    assert names.index("train.r1") < names.index("train.r2") < names.index("train.r3")
    assert names.index("draw.r3") < names.index("last")
    train = {r: manifest(first, f"train.r{r}") for r in (1, 2, 3)}
    assert train[1]["inputs"]["model"] == {"spec": "builtin:tiny", "resolved": "builtin:tiny",
                                           "digest": "hub:builtin:tiny"}
    for r in (2, 3):  # round r starts from round r-1's weights and trains on round r's draw
        previous = Path(next(s for s in first.stages if s.name == f"train.r{r - 1}").artifact)
        assert train[r]["inputs"]["model"]["resolved"] == str(previous / "out" / "model")
        assert train[r]["inputs"]["dataset"]["spec"] == f"stage:draw.r{r}"
    assert train[2]["round"] == {"loop": "grow", "stage": "train", "round": 2}
    # Round r runs with the pipeline's seed + r - 1: equal inputs and configs, three different draws.
    assert [manifest(first, f"draw.r{r}")["seed"] for r in (1, 2, 3)] == [5, 6, 7]
    draws = [rows(first, f"draw.r{r}") for r in (1, 2, 3)]
    assert len({tuple(d) for d in draws}) == 3 and all(len(d) == 4 for d in draws)
    assert rows(first, "last") == draws[2]  # `stage:grow.draw` is the last round's


def test_a_rerun_is_all_cached(first, project):
    again = run_pipeline(project / "rounds.yaml", [], project)
    assert statuses(again) == {name: "cached" for name in ROUND_3}
    assert [s.artifact for s in again.stages] == [s.artifact for s in first.stages]


def test_a_fourth_round_runs_alone(first, project):
    more = run_pipeline(project / "rounds.yaml", ["grow.repeat=4"], project)
    expected = {name: "cached" for name in ROUND_3} | {"draw.r4": "ran", "train.r4": "ran", "last": "ran"}
    assert statuses(more) == expected  # `last` reads the last round, now round 4
    before = {s.name: s.artifact for s in first.stages}
    assert all(s.artifact == before[s.name] for s in more.stages if s.status == "cached")
    previous = next(s for s in first.stages if s.name == "train.r3").artifact
    assert manifest(more, "train.r4")["inputs"]["model"]["resolved"] == str(Path(previous) / "out" / "model")


def test_each_round_is_an_mlflow_child_run_tagged_with_its_round(first, project):
    client = MlflowClient(tracking_uri(project))
    parent = client.get_run(first.mlflow_run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    tags = {r.info.run_name: r.data.tags for r in children}
    assert set(tags) == set(ROUND_3)
    for r in (1, 2, 3):
        for x in ("draw", "train"):
            t = tags[f"{x}.r{r}"]
            assert (t["alignflow.loop"], t["alignflow.loop_stage"], t["alignflow.round"]) == ("grow", x, str(r))
    assert "alignflow.round" not in tags["prompts"] and "alignflow.round" not in tags["last"]
    second = client.search_runs([parent.info.experiment_id], "tags.`alignflow.round` = '2'")
    assert {r.info.run_name for r in second} >= {"draw.r2", "train.r2"}


def test_rounds_one_to_three_keep_their_digests_when_repeat_grows(project):
    plugins = get_plugins()
    three = plan_pipeline(load_spec(project / "rounds.yaml", plugins), project, plugins)
    (project / "four.yaml").write_text(PIPELINE.replace("repeat: 3", "repeat: 4"))
    four = plan_pipeline(load_spec(project / "four.yaml", plugins), project, plugins)
    assert {n: three[n].digest for n in ROUND_3[:-1]} == {n: four[n].digest for n in ROUND_3[:-1]}
    assert three["last"].digest != four["last"].digest
    assert four["train.r4"].upstream == {"model": "train.r3", "dataset": "draw.r4"}
    assert (four["draw.r4"].seed, four["draw.r4"].input_digests) == (8, three["draw.r3"].input_digests)


def test_validate_prints_each_round_and_what_it_reads(project):
    out = subprocess.run([ALIGNFLOW, "validate", "rounds.yaml"], cwd=project, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "rounds (rounds.yaml): 8 stages, valid" in text
    assert "grow: loop of 3 rounds over draw, train" in text
    lines = [line.strip("│├└─ ") for line in text.splitlines()]
    assert lines.index("round 1") < lines.index("draw.r1 select subsample") < lines.index("round 2")
    r2 = lines.index("train.r2 sft sft")
    assert lines[r2 + 1: r2 + 3] == ["model <- stage:train.r1", "dataset <- stage:draw.r2"]
    r1 = lines.index("train.r1 sft sft")
    assert lines[r1 + 1] == "model <- builtin:tiny"  # first.train
    assert lines[lines.index("last select dedup") + 1] == "dataset <- stage:draw.r3"


def test_the_first_preflight_pass_names_a_loop_stage_once_without_torch(project):
    script = """
import sys
from pathlib import Path
from alignflow.core.errors import SpecError
from alignflow.flows.preflight import check_pipeline
early = []
try:
    check_pipeline(Path("rounds.yaml"), ["grow.stages.train.settings.lr=0"], Path("."),
                   early=lambda p: early.append(("torch" in sys.modules, p)))
except SpecError as exc:
    print("ERROR", str(exc).replace(chr(10), " | "))
print("EARLY", early)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=project, capture_output=True, text=True)
    early = done.stdout.split("EARLY", 1)[1]
    assert early.startswith(" [(False, ["), done.stderr[-2000:]
    assert early.count("stage 'grow.train', settings.lr: 0 would train nothing") == 1, early
    assert "1 problem found before any compute (listed above)" in done.stdout


def test_reproduce_reruns_a_pipeline_with_a_loop(project):
    (project / "draws.yaml").write_text(DRAWS)
    recorded = run_pipeline(project / "draws.yaml", [], project)
    assert [s.name for s in recorded.stages] == ["prompts", "draw.r1", "draw.r2", "draw.r3", "last"]
    done = reproduce(recorded.mlflow_run_id, project)
    assert statuses(done.report) == {s.name: "ran" for s in recorded.stages}
    assert (done.mismatches, done.environment, done.code) == ({}, {}, 0)  # same environment: exact
    assert done.report.final_metrics() == recorded.final_metrics()
