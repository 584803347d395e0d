"""`alignflow reproduce RUN_ID`: rerun a recorded pipeline run from scratch and compare its metrics.

In the environment the run was recorded in (every stage's fingerprint the same: library versions, CPU kind,
GPU, threads, precision) every final metric must match exactly. Elsewhere float sums differ in their last
bits and training drifts from them, so the differences are named and each metric is compared within a
tolerance instead; the exit code says which case it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from mlflow.tracking import MlflowClient

from alignflow.core.errors import AlignflowError
from alignflow.core.fingerprint import measured
from alignflow.flows.data import dvc
from alignflow.flows.options import REPRODUCE_TOLERANCE, RunOptions
from alignflow.flows.pipeline import NPROC_TAG, run_pipeline
from alignflow.flows.report import PipelineReport
from alignflow.flows.tracking import PARENT_TAG, mlflow_key, tracking_uri

EXACT, DIFFERS, ELSEWHERE = 0, 1, 3  # exit codes: matched exactly; did not match; within tolerance elsewhere
FP_TAG = "alignflow.fp."


def exact(a: float | None, b: float | None) -> bool:
    """The same value (NaN equals NaN); a metric on one side only never is."""
    return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))


def within(tolerance: float) -> Callable[[float | None, float | None], bool]:
    """A closeness for `compare_metrics`: |recorded - now| <= `tolerance` x max(1, |recorded|), absolute below
    one and relative above (see REPRODUCE_TOLERANCE); NaN is close only to NaN, a one-sided metric to nothing."""
    def close(a, b) -> bool:
        if a is None or b is None:
            return False
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return abs(a - b) <= tolerance * max(1.0, abs(a))

    return close


def compare_metrics(recorded: dict[str, float], now: dict[str, float],
                    close: Callable[[float | None, float | None], bool] = exact) -> dict[str, tuple]:
    """{key: (recorded, now)} for every metric that is not `close` (by default: not equal); keys as MLflow
    stored them."""
    now = {mlflow_key(k): v for k, v in now.items()}
    return {k: (recorded.get(k), now.get(k)) for k in sorted(set(recorded) | set(now))
            if not close(recorded.get(k), now.get(k))}


def fingerprints(client: MlflowClient, run_id: str) -> dict[str, dict[str, str]]:
    """{stage: its fingerprint tags (`alignflow.fp.*`, prefix removed)} of a pipeline run's stage runs."""
    parent = client.get_run(run_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.`{PARENT_TAG}` = '{run_id}'")
    return {r.info.run_name: {k[len(FP_TAG):]: v for k, v in r.data.tags.items() if k.startswith(FP_TAG)}
            for r in runs}


def environment_differences(recorded: dict[str, dict], now: dict[str, dict]) -> dict[str, tuple]:
    """{"stage: key": (recorded, now)} for each fingerprint entry that differs; a stage run recorded without a
    fingerprint (before there was one) differs as `fingerprint`. Measurements (the precision probe's seconds,
    core/fingerprint.py `MEASURED`) are not compared."""
    out = {}
    for stage in sorted(set(recorded) | set(now)):
        a, b = recorded.get(stage), now.get(stage)
        if not a or not b:
            out[f"{stage}: fingerprint"] = ("recorded" if a else None, "recorded" if b else None)
            continue
        out.update({f"{stage}: {k}": (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
                    if a.get(k) != b.get(k) and not measured(k)})
    return out


@dataclasses.dataclass
class Reproduction:
    """What a rerun found: the new report, the fingerprint entries that differ, the metrics that failed
    the comparison (exact when the environment is the same, else within the tolerance), and the exit code."""

    report: PipelineReport
    environment: dict[str, tuple]
    mismatches: dict[str, tuple]
    tolerance: float
    timed: list[str] = dataclasses.field(default_factory=list)  # stages whose weights depended on timing

    @property
    def code(self) -> int:
        if self.mismatches or self.report.failed:
            return DIFFERS
        return ELSEWHERE if self.environment else EXACT


def recorded_options(options: RunOptions, recorded: str | None) -> RunOptions:
    """`options` with the processes the run recorded (runs from before the tag: as they are)."""
    return options if recorded is None else dataclasses.replace(options, nproc=int(recorded))


@contextlib.contextmanager
def recorded_data_version(recorded: str | None, project: Path) -> Iterator[bool]:
    """Inside: the recorded data.dvc, checked out of the DVC cache (yields True if that changed
    anything). After: the data.dvc found before, checked out again, so the workspace is as it was."""
    current = project / "data.dvc"
    before = current.read_text() if current.is_file() else None
    if recorded is None or before == recorded:
        yield False
        return
    current.write_text(recorded)
    try:
        dvc(project, "checkout", "data.dvc")
        yield True
    finally:
        if before is None:
            current.unlink()
        else:
            current.write_text(before)
            dvc(project, "checkout", "data.dvc")


def reproduce(run_id: str, project: Path, options: RunOptions = RunOptions(),
              tolerance: float = REPRODUCE_TOLERANCE) -> Reproduction:
    """Rerun with a fresh artifacts root and `options`, on as many processes as the run recorded, and compare
    the final metrics: exactly where every stage's fingerprint is the recorded one, else within `tolerance`."""
    client = MlflowClient(tracking_uri(project))
    parent = client.get_run(run_id)
    if "mlflow.parentRunId" in parent.data.tags:
        raise AlignflowError(f"run {run_id} is a stage run; pass its parent (pipeline) run id")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(client.download_artifacts(run_id, "spec.yaml", tmp))
        names = {f.path for f in client.list_artifacts(run_id)}
        recorded_dvc = Path(client.download_artifacts(run_id, "data.dvc", tmp)).read_text() \
            if "data.dvc" in names else None
        options = recorded_options(options, parent.data.tags.get(NPROC_TAG))
        with recorded_data_version(recorded_dvc, project):
            # The spec's relative inputs are relative to the project, not to where it was downloaded.
            report = run_pipeline(spec, [], project, artifacts=Path(tmp) / "artifacts", options=options)
    recorded = fingerprints(client, run_id)
    environment = environment_differences(recorded, fingerprints(client, report.mlflow_run_id))
    timed = timing_dependent(recorded)
    close = within(tolerance) if environment or timed else exact
    return Reproduction(report, environment, compare_metrics(parent.data.metrics, report.final_metrics(), close),
                        tolerance, timed)


def timing_dependent(fingerprints: dict[str, dict[str, str]]) -> list[str]:
    """The stages whose fingerprint says their weights depend on timing (an rl stage's asynchronous rollouts on
    the newest weights, `async_weights: latest` or `partial`): compared within the tolerance even here."""
    return sorted(stage for stage, fp in fingerprints.items() if str(fp.get("timing_dependent")).lower() == "true")
