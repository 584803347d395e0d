"""`alignflow reproduce RUN_ID`: rerun a recorded pipeline run from scratch and compare its metrics."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import tempfile
from collections.abc import Iterator
from pathlib import Path

from mlflow.tracking import MlflowClient

from alignflow.core.errors import AlignflowError
from alignflow.flows.data import dvc
from alignflow.flows.options import RunOptions
from alignflow.flows.pipeline import NPROC_TAG, run_pipeline
from alignflow.flows.report import PipelineReport
from alignflow.flows.tracking import mlflow_key, tracking_uri


def compare_metrics(recorded: dict[str, float], now: dict[str, float]) -> dict[str, tuple]:
    """{key: (recorded, now)} for every metric that differs; keys as MLflow stored them, NaN equals NaN."""
    now = {mlflow_key(k): v for k, v in now.items()}

    def same(a, b) -> bool:
        return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))

    return {k: (recorded.get(k), now.get(k)) for k in sorted(set(recorded) | set(now))
            if not same(recorded.get(k), now.get(k))}


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


def reproduce(run_id: str, project: Path, options: RunOptions = RunOptions()) -> tuple[PipelineReport, dict[str, tuple]]:
    """Rerun with a fresh artifacts root and `options`, on as many processes as the run recorded; returns
    the new report and {metric: (recorded, now)} mismatches."""
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
    return report, compare_metrics(parent.data.metrics, report.final_metrics())
