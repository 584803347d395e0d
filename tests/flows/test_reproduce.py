"""Reproducibility: `alignflow reproduce` reruns an SFT run to the same final metrics; DVC's own
commands find the repository's lock file up to date and run its stage command."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient
from prefect.settings import PREFECT_API_URL

from alignflow.core.fingerprint import cpu
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.cli import main
from alignflow.flows.data import regenerate_data
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.preflight import check_pipeline
from alignflow.flows.reproduce import (compare_metrics, environment_differences, recorded_data_version,
                                      timing_dependent, within)
from alignflow.flows.tracking import tracking_uri

REPO = Path(__file__).resolve().parents[2]

PIPELINE = """
name: sft-reproduce
seed: 7
stages:
  data:
    kind: select
    inputs: {dataset: data/sft.jsonl}
    selectors: [dedup, {name: subsample, config: {n: 128}}]
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: "stage:data", eval_dataset: data/test.jsonl}
    algorithm: sft
    rewards: [math_accuracy]
    settings: {lr: 2.0e-3, max_steps: 12, batch_size: 8, micro_batch_size: 4, max_length: 96, save_every: 6,
               log_every: 4, eval_fraction: 0.125, eval_limit: 8,
               eval_generation: {max_new_tokens: 24, temperature: 0.0}}
"""


pytestmark = [pytest.mark.system, pytest.mark.usefixtures("one_thread")]


def child_env() -> dict[str, str]:
    """For a subprocess: the harness's Prefect server, the venv's commands, not this process's rank."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.update(PREFECT_API_URL=PREFECT_API_URL.value(), OMP_NUM_THREADS="1",
               PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}")
    return env


def test_reproduce_reruns_an_sft_run_to_identical_final_metrics(tmp_path, monkeypatch, capsys):
    write_datasets(tmp_path / "data")  # the bundled task, as `alignflow data` writes it
    (tmp_path / "sft.yaml").write_text(PIPELINE)
    first = run_pipeline(tmp_path / "sft.yaml", [], tmp_path)
    assert {s.name: s.status for s in first.stages} == {"data": "ran", "sft": "ran"}

    monkeypatch.chdir(tmp_path)
    code = main(["reproduce", first.mlflow_run_id])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "final metrics match exactly" in out

    # the rerun trained from scratch in a fresh artifacts root: nothing was reused
    client = MlflowClient(tracking_uri(tmp_path))
    parent = client.get_run(first.mlflow_run_id)
    runs = client.search_runs([parent.info.experiment_id], "tags.`alignflow.status` != ''")
    again = [r for r in runs if r.data.tags["mlflow.parentRunId"] != first.mlflow_run_id]
    assert sorted(r.data.tags["alignflow.status"] for r in again) == ["ran", "ran"]
    recorded = parent.data.metrics
    assert {"sft.train/loss", "sft.eval/loss", "sft.eval/accuracy", "sft.steps"} <= set(recorded)
    assert parent.data.tags["alignflow.nproc"] == "1"  # the processes a reproduction runs on
    assert not math.isnan(recorded["sft.train/loss"])

    # as if recorded elsewhere: another transformers on the sft stage, another CPU kind on both stages
    elsewhere = "AVX2" if cpu()["cpu_capability"] == "AVX512" else "AVX512"  # never this machine's own
    for run in client.search_runs([parent.info.experiment_id], f"tags.`mlflow.parentRunId` = '{first.mlflow_run_id}'"):
        if run.info.run_name == "sft":
            client.set_tag(run.info.run_id, "alignflow.fp.transformers", "4.0.0")
        client.set_tag(run.info.run_id, "alignflow.fp.cpu_capability", elsewhere)
    code = main(["reproduce", first.mlflow_run_id])
    out = capsys.readouterr().out
    assert code == 3, out  # the same numbers, here: within any tolerance
    assert "sft: transformers: 4.0.0 -> " in out and f"data: cpu_capability: {elsewhere} -> " in out
    assert "final metrics match within tolerance 0.05" in out
    # within a tolerance, not exactly: a recorded metric moved by more than the tolerance is named
    client.log_metric(first.mlflow_run_id, "sft.train/loss", recorded["sft.train/loss"] + 0.5)
    code = main(["reproduce", first.mlflow_run_id, "--tolerance", "0.1"])
    out = capsys.readouterr().out
    assert code == 1 and "sft.train/loss" in out and "not reproduced (within tolerance 0.1)" in out, out


def test_the_rerun_takes_the_recorded_process_count_and_leaves_the_environment_alone():
    from alignflow.flows.options import RunOptions
    from alignflow.flows.reproduce import recorded_options

    before = dict(os.environ)
    given = RunOptions(nproc=4, parallel=2)
    assert recorded_options(given, "2") == RunOptions(nproc=2, parallel=2)
    assert recorded_options(given, None) is given  # a run from before the tag: the options as given
    assert dict(os.environ) == before


def test_the_recorded_data_version_is_checked_out_for_the_rerun_then_put_back(tmp_path):
    dvc(tmp_path, "init", "--no-scm")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "rows.jsonl").write_text('{"v": 1}\n')
    dvc(tmp_path, "add", "data")
    recorded = (tmp_path / "data.dvc").read_text()
    (tmp_path / "data" / "rows.jsonl").write_text('{"v": 2}\n')
    dvc(tmp_path, "add", "data")
    current = (tmp_path / "data.dvc").read_text()
    assert current != recorded
    with recorded_data_version(recorded, tmp_path) as changed:
        assert changed
        assert (tmp_path / "data" / "rows.jsonl").read_text() == '{"v": 1}\n'
    assert (tmp_path / "data.dvc").read_text() == current
    assert (tmp_path / "data" / "rows.jsonl").read_text() == '{"v": 2}\n'
    with recorded_data_version(current, tmp_path) as changed:  # already there: nothing to do
        assert not changed


def test_metric_comparison_matches_mlflow_keys_and_nan():
    recorded = {"s.eval/pass_at_1": 0.5, "s.train/loss": math.nan, "s.steps": 10.0}
    assert compare_metrics(recorded, {"s.eval/pass@1": 0.5, "s.train/loss": math.nan, "s.steps": 10.0}) == {}
    assert compare_metrics(recorded, {"s.eval/pass@1": 0.5, "s.train/loss": 1.0}) == {
        "s.train/loss": (recorded["s.train/loss"], 1.0), "s.steps": (10.0, None)}
    assert compare_metrics({"s.steps": 10.0}, {"s.steps": 10.0 + 1e-12}) == {  # exact unless told otherwise
        "s.steps": (10.0, 10.0 + 1e-12)}


def test_within_a_tolerance_is_absolute_below_one_and_relative_above():
    recorded = {"s.eval/accuracy": 0.258, "s.train/loss": 20.0, "s.steps": 10.0, "s.nan": math.nan}
    now = {"s.eval/accuracy": 0.290, "s.train/loss": 21.5, "s.steps": 10.0, "s.nan": math.nan}
    # 0.032 <= 0.05; 1.5 > 5% of 20
    assert compare_metrics(recorded, now, within(0.05)) == {"s.train/loss": (20.0, 21.5)}
    assert compare_metrics(recorded, now, within(0.1)) == {}
    assert compare_metrics(recorded, {**now, "s.steps": None}, within(0.1)) == {"s.steps": (10.0, None)}
    close = within(0.05)
    assert not close(math.nan, 0.0) and not close(0.0, math.nan) and not close(1.0, None)


def test_the_command_lines_tolerance_default_is_read_without_importing_the_reproduce_module():
    code = ("import sys; from alignflow.flows.cli import build_parser; "
            "from alignflow.flows.options import REPRODUCE_TOLERANCE as T; "
            "args = build_parser().parse_args(['reproduce', 'RUN']); "
            "print(args.tolerance == T == 0.05, 'alignflow.flows.reproduce' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "False"]


def test_environment_differences_name_the_stage_and_entry():
    a = {"sft": {"transformers": "5.24.0", "cpu_capability": "AVX2"}, "data": {"cpu_capability": "AVX2"}}
    b = {"sft": {"transformers": "5.24.0", "cpu_capability": "AVX512"}, "data": {}}
    assert environment_differences(a, a) == {}
    assert environment_differences(a, b) == {"data: fingerprint": ("recorded", None),
                                             "sft: cpu_capability": ("AVX2", "AVX512")}


def test_a_stage_whose_weights_depend_on_timing_is_compared_within_the_tolerance():
    """An rl stage's fingerprint says whether its asynchronous rollouts took the newest weights (as a tag: text)."""
    recorded = {"grpo": {"timing_dependent": "True"}, "sft": {}, "pinned": {"timing_dependent": "False"}}
    assert timing_dependent(recorded) == ["grpo"]


def dvc(cwd: Path, *args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=cwd, env=child_env(),
                          capture_output=True, text=True)
    assert done.returncode == 0, f"dvc {' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


TINY = """
name: tiny
seed: 0
stages:
  rl_sample:
    kind: select
    inputs: {dataset: data/rl.jsonl}
    selectors: [dedup, {name: subsample, config: {n: 64}}]
"""


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    """A git clone of the repository with data/ regenerated (the clone has no DVC cache)."""
    root = tmp_path_factory.mktemp("repo") / "clone"
    subprocess.run(["git", "clone", "-q", str(REPO), str(root)], check=True)
    regenerate_data(root)  # byte-identical to what data.dvc pins
    return root


def test_dvc_yaml_runs_valid_pipelines_and_its_lock_is_current(clone):
    """Every stage runs `alignflow run` on a valid spec it depends on, with the data folders it reads, declares
    the metrics and plots the command writes, and, once the committed dvc.lock records it, is up to date in a
    fresh clone."""
    stages = yaml.safe_load((clone / "dvc.yaml").read_text())["stages"]
    assert {"r1-tiny", "tools-tiny", "reasoning-gym-tiny", "multidomain-prm-tiny", "gigpo-tiny"} <= set(stages)
    for name, stage in stages.items():
        args = stage["cmd"].split()
        assert args[:2] == ["alignflow", "run"] and args[2] == f"pipelines/{name}.yaml", name
        spec = check_pipeline(clone / args[2], [], Path("."), regenerate=True).spec  # its plugin configs validate
        assert args[2] in stage["deps"], name
        for path in (Path(v) for s in spec.stages.values() for v in s.inputs.values() if v.startswith("data/")):
            assert path.parent.as_posix() in stage["deps"], (name, path)  # its data folder: a change reruns it
        assert [next(iter(m)) for m in stage["metrics"]] == [args[args.index("--metrics") + 1]], name
        assert [next(iter(p)) for p in stage["plots"]] == [args[args.index("--plots") + 1]], name

    dvc(clone, "repro", "data.dvc")  # the regenerated data/ is what data.dvc pins: nothing to redo
    status = json.loads(dvc(clone, "status", "--json"))
    lock = clone / "dvc.lock"
    locked = set((yaml.safe_load(lock.read_text() if lock.is_file() else "") or {}).get("stages", {}))
    locked &= set(stages)  # a stage runs once before its lock entry is committed
    assert not {s: status[s] for s in ["data.dvc", *locked] if s in status}
    shown = json.loads(dvc(clone, "metrics", "show", "--json"))[""]["data"]
    for path in (next(iter(m)) for s in locked for m in stages[s]["metrics"]):
        assert shown[path]["data"] == json.loads((clone / path).read_text())


def test_dvc_repro_runs_the_stage_command_and_tracks_its_metrics(clone):
    """The repository's stage, pointed at a tiny pipeline: DVC runs it, shows its metrics, and skips
    an unchanged rerun (whatever the default pipeline costs, this stays lean)."""
    spec = yaml.safe_load((clone / "dvc.yaml").read_text())
    name, stage = next(iter(spec["stages"].items()))
    pipeline = stage["cmd"].split()[2]  # alignflow run PIPELINE ...
    text = yaml.safe_dump({"stages": {name: stage}}).replace(pipeline, "pipelines/tiny.yaml")
    (clone / "dvc.yaml").write_text(text)
    (clone / "pipelines" / "tiny.yaml").write_text(TINY)
    metrics_file = clone / next(iter(stage["metrics"][0]))

    assert f"Running stage '{name}'" in dvc(clone, "repro", name)
    assert json.loads(metrics_file.read_text())["rl_sample"]["rows_out"] == 64.0
    shown = json.loads(dvc(clone, "metrics", "show", "--json"))[""]["data"]
    assert shown[metrics_file.relative_to(clone).as_posix()]["data"]["rl_sample"]["rows_out"] == 64.0
    assert "didn't change, skipping" in dvc(clone, "repro", name)
    assert "Data and pipelines are up to date" in dvc(clone, "status")
