"""The end-of-run summary: a rich table for people, one JSON line for programs."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

STATUS_STYLE = {"ran": "green", "cached": "cyan", "resumed": "yellow", "failed": "bold red",
                "skipped": "dim"}


@dataclass
class StageReport:
    name: str
    kind: str
    status: str  # ran | cached | resumed | failed | skipped
    seconds: float
    metrics: dict[str, float]
    headline: str | None
    artifact: str | None
    error: str | None = None
    model_version: str | None = None  # set when this stage's model was registered in MLflow


@dataclass
class PipelineReport:
    run_id: str  # the Prefect flow run
    mlflow_run_id: str
    pipeline: str
    stages: list[StageReport] = field(default_factory=list)
    tracking_uri: str = ""
    seconds: float = 0.0

    @property
    def failed(self) -> list[StageReport]:
        return [s for s in self.stages if s.status == "failed"]

    def final_metrics(self) -> dict[str, float]:
        """Every stage's final metrics as `stage.metric`, for the parent run and DVC."""
        return {f"{s.name}.{k}": v for s in self.stages for k, v in s.metrics.items()}

    def as_json(self) -> str:
        """The `--json` line: run ids and, per stage, name, kind, status, seconds and metrics."""
        stages = [{"name": s.name, "kind": s.kind, "status": s.status, "seconds": round(s.seconds, 3),
                   "metrics": s.metrics} for s in self.stages]
        summary = {"run_id": self.run_id, "mlflow_run_id": self.mlflow_run_id, "stages": stages}
        return json.dumps(json_safe(summary), allow_nan=False)

    def render(self, console: Console) -> None:
        """The stage table, the errors, and how to open both UIs."""
        table = Table(title=f"{self.pipeline}: {len(self.stages)} stages in {self.seconds:.1f} s",
                      box=box.SIMPLE_HEAD)
        for col in ("stage", "kind", "status", "seconds", "headline"):
            table.add_column(col, overflow="fold")
        for s in self.stages:
            headline = f"{s.headline}={s.metrics[s.headline]:.4g}" if s.headline else ""
            table.add_row(s.name, s.kind, f"[{STATUS_STYLE[s.status]}]{s.status}[/]", f"{s.seconds:.1f}", headline)
        console.print(table)
        for s in self.stages:  # one line each, copyable
            if s.artifact:
                console.print(f"  {s.name}: {shown_path(s.artifact)}", highlight=False, soft_wrap=True)
        for s in self.failed:
            console.print(f"[bold red]{s.name} failed:[/] {escape(str(s.error))}", highlight=False)
        console.print(f"MLflow run {self.mlflow_run_id}: mlflow ui --backend-store-uri {self.tracking_uri}")
        console.print(f"Prefect flow run {self.run_id}: prefect server start  (then open http://127.0.0.1:4200)")


def shown_path(path: str | None) -> str:
    """An artifact folder relative to the working directory when it is under it: a table row, not four."""
    if not path:
        return ""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return path


def json_safe(obj):
    """`obj` with NaN and infinities as None: `json.dumps` would write `NaN`, which is not JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj


def write_metrics(report: PipelineReport, path: Path) -> None:
    """Final metrics {stage: {metric: value}} as JSON, for `dvc metrics show`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    metrics = {s.name: s.metrics for s in report.stages if s.metrics}
    path.write_text(json.dumps(json_safe(metrics), indent=2, sort_keys=True, allow_nan=False) + "\n")


def write_curves(report: PipelineReport, folder: Path) -> None:
    """One `step,value` CSV per stage metric logged with steps, for `dvc plots show`."""
    for s in report.stages:
        curves_file = Path(s.artifact) / "curves.json" if s.artifact else None
        if curves_file is None or not curves_file.is_file():
            continue
        for metric, points in json.loads(curves_file.read_text()).items():
            out = folder / s.name / f"{metric.replace('/', '_')}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text("step,value\n" + "".join(f"{int(st)},{v}\n" for st, v in points))
