"""The bundled input data under `data/`, tracked by DVC in `data.dvc`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from alignflow.core.errors import AlignflowError
from alignflow.core.spec.schema import PipelineSpec

DATA_DIR = "data"


def regenerate_data(project: Path, seed: int = 0) -> dict[str, Path]:
    """Write the bundled task's datasets into `data/`; byte-identical, so DVC sees no change."""
    from alignflow.core.task.arithmetic import write_datasets

    return write_datasets(project / DATA_DIR, seed=seed)


def needs_data(spec: PipelineSpec, project: Path) -> bool:
    """Whether some stage reads a file under `data/` that is missing."""
    for stage in spec.stages.values():
        for value in stage.inputs.values():
            path = Path(value)
            if path.parts[:1] == (DATA_DIR,) and not (project / path).exists():
                return True
    return False


def ensure_data(spec: PipelineSpec, project: Path) -> None:
    """Regenerate `data/` when a stage reads from it and it is missing."""
    if needs_data(spec, project):
        regenerate_data(project)


def dvc(project: Path, *args: str) -> str:
    """Run a DVC command in the project; a failure raises with DVC's own message."""
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)
    if done.returncode != 0:
        raise AlignflowError(f"dvc {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def reasoning_gym_data(args) -> list[str]:
    """`size` rows of a reasoning-gym task from a seed, as JSONL (the same command writes the same bytes)."""
    from alignflow.core.task.arithmetic import write_jsonl
    from alignflow.plugins.reasoning_gym import task_rows

    config = dict(_key_value(item) for item in args.config)
    out = Path(args.out or f"{DATA_DIR}-reasoning-gym/{args.task}-seed{args.seed}-{args.size}.jsonl")
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, task_rows(args.task, args.size, args.seed, config, excluded_prompts(args.exclude)))
    return [f"{args.task}: {args.size} rows (seed {args.seed}) -> {out}"]


def reasoning_gym_steps_data(args) -> list[str]:
    """`size` rows of each of several reasoning-gym tasks with a teacher's worked step-wise solutions."""
    from alignflow.core.task.arithmetic import write_jsonl
    from alignflow.plugins.reasoning_gym_steps import step_rows

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    rows = step_rows(tasks, args.size, args.seed, args.teacher, excluded_prompts(args.exclude))
    if args.columns:
        keep = [c.strip() for c in args.columns.split(",") if c.strip()]
        missing = [c for c in keep if c not in rows[0]]
        if missing:
            raise AlignflowError(f"--columns: {', '.join(missing)} not among the rows' ({', '.join(rows[0])})")
        rows = [{c: row[c] for c in keep} for row in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_jsonl(out, rows)
    return [f"{','.join(tasks)}: {len(rows)} rows, {args.teacher} teacher (seed {args.seed}) -> {out}"]


def excluded_prompts(paths: list[str]) -> set[str]:
    """The prompts of JSONL files (a training set's, for a test set)."""
    exclude: set[str] = set()
    for path in paths:
        try:
            exclude |= {json.loads(line)["prompt"] for line in Path(path).read_text().splitlines() if line.strip()}
        except (OSError, ValueError, KeyError) as exc:
            raise AlignflowError(f"--exclude {path}: expected a JSONL file of rows with a prompt ({exc})") from None
    return exclude


def _key_value(item: str) -> tuple[str, object]:
    """`key=value` with a YAML value (`min_terms=3` gives an int)."""
    import yaml

    key, sep, value = item.partition("=")
    if not sep or not key:
        raise AlignflowError(f"--config {item!r}: expected KEY=VALUE")
    return key, yaml.safe_load(value)
