"""The `select` stage: read a JSONL dataset, apply the selectors in order, write the rows kept.

A selector is a `Selector` subclass called as `selector(rows: list[dict], rng: random.Random)
-> list[dict]`: plain rows, because selection is cheap and a list is what every selector reads
most simply. Each selector gets its own `random.Random`, seeded from the stage seed and its
position, so adding a selector never changes the draws of the ones before it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from alignflow.core.data import iter_jsonl
from alignflow.core.errors import DataError, SpecError
from alignflow.core.spec import validate_config
from alignflow.flows.stages import StageContext, StageResult


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSONL file; a bad line raises `file:row: ...`."""
    if path.is_dir():
        raise DataError(f"{path}: a select stage reads one JSONL file, got a folder")
    rows = []
    for line_no, row in iter_jsonl(path):
        if not isinstance(row, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    return rows


def write_jsonl(rows: list[dict], path: Path) -> None:
    """Write rows one per line, keys in their given order, so equal rows give equal bytes."""
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def run_select(ctx: StageContext) -> StageResult:
    """Apply `ctx.spec.selectors` in order; log the row count after each as a step metric."""
    source = ctx.inputs["dataset"]
    if not isinstance(source, Path):
        raise SpecError(f"stage {ctx.name!r}, inputs.dataset: {source!r} is not a local file")
    rows = read_jsonl(source)
    n_in = len(rows)
    ctx.log_metrics({"rows": float(n_in)}, 0)
    for step, ref in enumerate(ctx.spec.selectors, start=1):
        cls = ctx.plugins.selectors.get(ref.name)
        where = f"stage {ctx.name!r}, selectors[{step - 1}].config"
        selector = cls(validate_config(cls, ref.config, where))
        rows = selector(rows, random.Random(f"{ctx.seed}:{step}"))
        ctx.log_metrics({"rows": float(len(rows))}, step)
    out = ctx.work_dir / "data.jsonl"
    write_jsonl(rows, out)
    metrics = {"rows_in": float(n_in), "rows_out": float(len(rows)),
               "kept_fraction": len(rows) / n_in if n_in else 0.0}
    return StageResult(outputs={"dataset": out}, metrics=metrics, headline="rows_out")
