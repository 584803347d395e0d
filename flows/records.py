"""`alignflow reproduce RECORD`: rerun a committed run record and judge the rerun against its seed band.

A record (metrics/NAME.json, written by benchmarks/seed_band.py) holds the pipeline, and per seed each stage's
digest, fingerprint and final metrics, and per stage and metric the band over the seeds: mean, standard error and
the values. The rerun runs the pipeline with one of the record's seeds in a fresh artifacts root; a metric is
inside the band when it lies within mean +- 2 sample standard deviations of the seeds' values (or between their
least and greatest): one new draw from the same spread lands there about 95% of the time. Exit 0 inside the band,
3 outside it where the environment differs from the seed's record (library versions, CPU kind, or the numerics
epoch of the code: the band is that environment's), 1 outside it in the same environment.
"""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from alignflow.core.errors import AlignflowError
from alignflow.core.fingerprint import NUMERICS
from alignflow.flows.options import RunOptions
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.report import PipelineReport
from alignflow.flows.reproduce import DIFFERS, ELSEWHERE, EXACT, environment_differences
from alignflow.flows.tracking import flatten

SPREAD = 2.0  # sample standard deviations either side of the seeds' mean


@dataclass
class RecordCheck:
    """A rerun of one seed of a record: the report, the fingerprint entries that differ from the seed's, and the
    metrics outside the band ({"stage.metric": (now, low, high)})."""

    report: PipelineReport
    seed: int
    environment: dict[str, tuple]
    outside: dict[str, tuple] = field(default_factory=dict)

    @property
    def code(self) -> int:
        if self.report.failed or (self.outside and not self.environment):
            return DIFFERS
        return ELSEWHERE if self.outside else EXACT


def band_interval(band: dict) -> tuple[float, float]:
    """The interval a rerun's value must lie in: mean +- SPREAD sample standard deviations of the seeds' values,
    widened to hold every recorded value."""
    values = band["values"]
    sd = band["se"] * math.sqrt(len(values)) if band.get("se") else 0.0
    return min(band["mean"] - SPREAD * sd, *values), max(band["mean"] + SPREAD * sd, *values)


def manifests(root: Path) -> dict[str, dict]:
    """The manifest of each stage run under an artifacts root, by stage name."""
    return {m["stage"]: m for m in (json.loads(p.read_text()) for p in root.glob("*/*/manifest.json"))}


def read_record(path: Path) -> dict:
    try:
        record = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise AlignflowError(f"{path}: not a readable run record ({e})") from None
    missing = [k for k in ("pipeline", "seeds", "bands") if k not in record]
    if missing:
        raise AlignflowError(f"{path}: a run record needs {', '.join(missing)} (benchmarks/seed_band.py writes one)")
    return record


def check_record(path: Path, project: Path, options: RunOptions | None = None, seed: int | None = None,
                 artifacts: Path | None = None) -> RecordCheck:
    """Rerun the record's pipeline with `seed` (default: its first) and compare with its band; `artifacts`: the
    root to run in (default a fresh temporary one, so nothing is reused)."""
    record = read_record(path)
    seed = int(next(iter(record["seeds"]))) if seed is None else seed
    with tempfile.TemporaryDirectory() as tmp:
        root = artifacts or Path(tmp) / "artifacts"
        report = run_pipeline(project / record["pipeline"], [f"seed={seed}"], project, artifacts=root,
                              options=options)
        now = {name: flatten(m.get("fingerprint") or {}) for name, m in manifests(root).items()}
    recorded = record["seeds"].get(str(seed)) or next(iter(record["seeds"].values()))
    environment = environment_differences({name: flatten(s["fingerprint"]) for name, s in recorded.items()}, now)
    if record.get("numerics") != NUMERICS:  # made by code that computed otherwise: the band is that code's
        environment["numerics"] = (record.get("numerics"), NUMERICS)
    metrics = report.final_metrics()
    outside = {}
    for stage, bands in record["bands"].items():
        for metric, band in bands.items():
            low, high = band_interval(band)
            value = metrics.get(f"{stage}.{metric}")
            if value is None or not low <= value <= high:
                outside[f"{stage}.{metric}"] = (value, low, high)
    return RecordCheck(report, seed, environment, outside)


def render(done: RecordCheck, console) -> int:
    """Print what the check found; its exit code."""
    done.report.render(console)
    for key, (recorded, now) in done.environment.items():
        console.print(f"  environment differs, {key}: {recorded} -> {now}")
    for key, (value, low, high) in sorted(done.outside.items()):
        console.print(f"[red]{key}[/red]: {value} outside the band [{low:.4g}, {high:.4g}]")
    if done.code == EXACT:
        console.print(f"[green]seed {done.seed}: every metric inside the record's band[/green]")
    elif done.code == ELSEWHERE:
        console.print("[yellow]outside the band, in another environment than the record's[/yellow]")
    else:
        console.print("[red]not reproduced[/red]: outside the record's band in its own environment")
    return done.code
