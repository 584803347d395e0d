"""`alignflow reproduce RUN_ID`: rerun a recorded pipeline run from scratch and compare its metrics."""

from __future__ import annotations

import math
import tempfile
from pathlib import Path

from alignflow.core.errors import AlignflowError
from alignflow.flows.data import dvc
from alignflow.flows.report import PipelineReport
from alignflow.flows.tracking import mlflow_key, tracking_uri


def compare_metrics(recorded: dict[str, float], now: dict[str, float]) -> dict[str, tuple]:
    """{key: (recorded, now)} for every metric that differs; keys as MLflow stored them, NaN equals NaN."""
    now = {mlflow_key(k): v for k, v in now.items()}

    def same(a, b) -> bool:
        return a == b or (a is not None and b is not None and math.isnan(a) and math.isnan(b))

    return {k: (recorded.get(k), now.get(k)) for k in sorted(set(recorded) | set(now))
            if not same(recorded.get(k), now.get(k))}


def restore_data_version(recorded: str | None, project: Path) -> bool:
    """Write the recorded data.dvc back and `dvc checkout` it from the cache; True if it changed."""
    current = project / "data.dvc"
    if recorded is None or (current.is_file() and current.read_text() == recorded):
        return False
    current.write_text(recorded)
    dvc(project, "checkout", "data.dvc")
    return True


def reproduce(run_id: str, project: Path) -> tuple[PipelineReport, dict[str, tuple]]:
    """Rerun with a fresh artifacts root; returns the new report and {metric: (recorded, now)} mismatches."""
    from mlflow.tracking import MlflowClient

    from alignflow.flows.pipeline import run_pipeline

    client = MlflowClient(tracking_uri(project))
    parent = client.get_run(run_id)
    if "mlflow.parentRunId" in parent.data.tags:
        raise AlignflowError(f"run {run_id} is a stage run; pass its parent (pipeline) run id")
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(client.download_artifacts(run_id, "spec.yaml", tmp))
        names = {f.path for f in client.list_artifacts(run_id)}
        recorded_dvc = Path(client.download_artifacts(run_id, "data.dvc", tmp)).read_text() \
            if "data.dvc" in names else None
        restore_data_version(recorded_dvc, project)
        # The spec's relative inputs are relative to the project, not to where it was downloaded.
        report = run_pipeline(spec, [], project, artifacts=Path(tmp) / "artifacts")
    return report, compare_metrics(parent.data.metrics, report.final_metrics())
