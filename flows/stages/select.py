"""The `select` stage: read a JSONL dataset, score it with the stage's rewards (if any), apply the
selectors in order, write the rows kept.

With `rewards`, every row is a prompt/completion row and gets each reward's score under
`rewards.NAME` (the shape of an `evaluate` stage's samples) before the first selector runs, so
`quality` can keep the rows a verifier, judge or reward model scores highest (LIMO-style curation of
SFT data) and `difficulty`/`column_filter` can read them. A reward that fails on a row writes null.

A selector is a `Selector` subclass called as `selector(rows: list[dict], rng: random.Random)
-> list[dict]`: plain rows, because selection is cheap and a list is what every selector reads
most simply. Each selector gets its own `random.Random`, seeded from the stage seed and its
position, so adding a selector never changes the draws of the ones before it.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from alignflow.core import seeds
from alignflow.core.train.datasets import iter_jsonl
from alignflow.core.errors import DataError, SpecError
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


def score_rows(ctx: StageContext, rows: list[dict], source: Path) -> dict[str, float]:
    """Add `rewards.NAME` to each prompt/completion row (every other column reaches the rewards, as a
    dataset's columns do in the sampling stages); returns the rewards' metrics (means, failures)."""
    from alignflow.flows.stages.scoring import reward_set  # loads torch: only a stage that scores pays for it

    rewards = reward_set(ctx)
    names = [r.name for r in rewards.rewards]
    for i, row in enumerate(rows):
        for key in ("prompt", "completion"):
            if not isinstance(row.get(key), str):
                raise DataError(f"{source}:{i + 1}: stage {ctx.name!r} scores rows with rewards and needs a "
                                f"string {key!r}, got {row.get(key)!r}")
        clash = set(names) & set(row.get("rewards") or {})
        if (row.get("rewards") is not None and not isinstance(row["rewards"], dict)) or clash:
            raise DataError(f"{source}:{i + 1}: 'rewards' already holds {row['rewards']!r}; the stage would "
                            f"write {', '.join(names)} there (rename the column or the reward)")
    columns = {k: [row.get(k) for row in rows] for k in {k for row in rows for k in row}
               if k not in ("prompt", "completion", "rewards")}
    out = rewards([r["prompt"] for r in rows], [r["completion"] for r in rows], **columns)
    for j, row in enumerate(rows):
        row["rewards"] = {**(row.get("rewards") or {}), **{name: out.values[name][j] for name in names}}
    return out.metrics


def run_select(ctx: StageContext) -> StageResult:
    """Score the rows when the stage has rewards, then apply `ctx.spec.selectors` in order; log the row
    count after each as a step metric."""
    source = ctx.inputs["dataset"]
    if not isinstance(source, Path):
        raise SpecError(f"stage {ctx.name!r}, inputs.dataset: {source!r} is not a local file")
    rows = read_jsonl(source)
    n_in = len(rows)
    scored = score_rows(ctx, rows, source) if ctx.spec.rewards else {}
    ctx.log_metrics({"rows": float(n_in)}, 0)
    for step, use in enumerate(ctx.resolved.selectors, start=1):
        selector = use.build()
        rows = selector(rows, random.Random(seeds.selector(ctx.seed, step)))
        ctx.log_metrics({"rows": float(len(rows))}, step)
    out = ctx.work_dir / "data.jsonl"
    write_jsonl(rows, out)
    metrics = {"rows_in": float(n_in), "rows_out": float(len(rows)),
               "kept_fraction": len(rows) / n_in if n_in else 0.0, **scored}
    return StageResult(outputs={"dataset": out}, metrics=metrics, headline="rows_out")
