"""Every dataset under `data/`, tracked by DVC in `data.dvc`, and the `alignflow data` commands that write it."""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from alignflow.core.errors import AlignflowError
from alignflow.core.spec.schema import PipelineSpec

DATA_DIR = "data"
BUNDLED = "."  # the arithmetic task's files, directly under data/ (r1-tiny and most tiny recipes read them)
# The recipes' datasets, by folder under data/: the commands that write them, byte for byte, from the project's
# root. `alignflow data` runs them all; data.dvc pins the result (tests/flows/test_data_regeneration.py).
RECIPE_DATA = {
    "tool-use": ["alignflow data tool-use --out data/tool-use"],
    "reasoning-gym": [
        "alignflow data reasoning-gym spell_backward --size 4000 --seed 0 --config max_word_len=7 "
        "--out data/reasoning-gym/spell_backward-train.jsonl",
        "alignflow data reasoning-gym spell_backward --size 400 --seed 1000000 --config max_word_len=7 "
        "--exclude data/reasoning-gym/spell_backward-train.jsonl --out data/reasoning-gym/spell_backward-test.jsonl",
    ],
    "multidomain": [
        "alignflow data reasoning-gym-steps --tasks chain_sum,spell_backward,count_bits,letter_counting,gcd "
        "--size 600 --seed 0 --teacher sloppy --columns prompt,completion,task --out data/multidomain/sft-sloppy.jsonl",
        "alignflow data reasoning-gym-steps --tasks chain_sum,spell_backward,count_bits,letter_counting,gcd "
        "--size 600 --seed 0 --teacher clean --columns prompt,completion,task --out data/multidomain/sft-clean.jsonl",
        "alignflow data reasoning-gym-steps --tasks chain_sum,spell_backward,count_bits --size 100 --seed 100000 "
        "--exclude data/multidomain/sft-clean.jsonl --out data/multidomain/label-prompts.jsonl",
        "alignflow data reasoning-gym-steps --tasks chain_sum,spell_backward,count_bits,letter_counting,gcd "
        "--size 100 --seed 1000000 --exclude data/multidomain/sft-clean.jsonl "
        "--exclude data/multidomain/label-prompts.jsonl --out data/multidomain/test.jsonl",
    ],
}


def regenerate_data(project: Path, seed: int = 0, folders: set[str] | None = None) -> dict[str, Path]:
    """Write the datasets of `folders` (BUNDLED and RECIPE_DATA's keys; default all) into `data/`, byte-identical,
    so DVC sees no change. Returns {name: path}; a recipe folder whose library is missing raises."""
    from alignflow.core.task.arithmetic import write_datasets

    written = {}
    if folders is None or BUNDLED in folders:
        written.update(write_datasets(project / DATA_DIR, seed=seed))
    for folder, commands in RECIPE_DATA.items():
        if folders is None or folder in folders:
            for command in commands:
                written.update(run_data_command(command, project))
    return written


def run_data_command(command: str, project: Path) -> dict[str, Path]:
    """Run one `alignflow data SOURCE ...` command of RECIPE_DATA in this process, its paths under `project`."""
    parser = argparse.ArgumentParser(prog="alignflow data")
    add_sources(parser.add_subparsers(dest="source", required=True))
    args = parser.parse_args(shlex.split(command)[2:])
    args.out = str(project / args.out)
    args.exclude = [str(project / p) for p in getattr(args, "exclude", [])]
    WRITERS[args.source](args)
    out = Path(args.out)
    files = sorted(out.glob("*.jsonl")) if out.is_dir() else [out]
    return {str(f.relative_to(project / DATA_DIR).with_suffix("")): f for f in files}


def folder_of(path: Path) -> str | None:
    """The data folder a path under `data/` belongs to (BUNDLED or a RECIPE_DATA key); None outside data/."""
    parts = path.parts
    if parts[:1] != (DATA_DIR,) or len(parts) < 2:
        return None
    return parts[1] if len(parts) > 2 and parts[1] in RECIPE_DATA else BUNDLED


def needs_data(spec: PipelineSpec, project: Path) -> set[str]:
    """The data folders holding a file some stage reads that is missing (empty: none)."""
    missing = set()
    for stage in spec.stages.values():
        for value in stage.inputs.values():
            path = Path(value)
            folder = folder_of(path)
            if folder is not None and not (project / path).exists():
                missing.add(folder)
    return missing


def ensure_data(spec: PipelineSpec, project: Path) -> None:
    """Regenerate the data folders a stage reads from where a file of them is missing."""
    missing = needs_data(spec, project)
    if missing:
        regenerate_data(project, folders=missing)


def dvc(project: Path, *args: str) -> str:
    """Run a DVC command in the project; a failure raises with DVC's own message."""
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=project, capture_output=True, text=True)
    if done.returncode != 0:
        raise AlignflowError(f"dvc {' '.join(args)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def tool_use_data(args) -> list[str]:
    """The tool-use task's files (a sloppy teacher's transcripts, rl and test prompts) into a folder."""
    from alignflow.core.task.tool_use import write_tool_datasets

    return [f"{name}: {path}" for name, path in write_tool_datasets(Path(args.out)).items()]


def reasoning_gym_data(args) -> list[str]:
    """`size` rows of a reasoning-gym task from a seed, as JSONL (the same command writes the same bytes)."""
    from alignflow.core.task.arithmetic import write_jsonl
    from alignflow.plugins.reasoning_gym import task_rows

    config = dict(_key_value(item) for item in args.config)
    out = Path(args.out or f"{DATA_DIR}/reasoning-gym/{args.task}-seed{args.seed}-{args.size}.jsonl")
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


WRITERS = {"tool-use": tool_use_data, "reasoning-gym": reasoning_gym_data,
           "reasoning-gym-steps": reasoning_gym_steps_data}


def add_sources(sources) -> None:
    """The `alignflow data SOURCE` subcommands, on an argparse subparsers object."""
    q = sources.add_parser("tool-use", help="the bundled tool-use task: a sloppy teacher's transcripts, rl and "
                           "test prompts (the same bytes each time)")
    q.add_argument("--out", default="data/tool-use", help="the folder to write (default data/tool-use)")
    q = sources.add_parser("reasoning-gym", help="rows of a reasoning-gym task, generated from a seed")
    q.add_argument("task", help="the task's name, e.g. chain_sum, basic_arithmetic, leg_counting")
    q.add_argument("--size", type=int, default=500, help="rows (default 500)")
    q.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0); row i comes from seed + i, "
                   "so sets from seeds closer than their size share rows")
    q.add_argument("--config", action="append", default=[], metavar="KEY=VALUE",
                   help="the task's own options, e.g. min_terms=2 (repeatable)")
    q.add_argument("--exclude", action="append", default=[], metavar="JSONL",
                   help="skip rows whose prompt is in this file (a training set, for a test set); repeatable")
    q.add_argument("--out", help="the JSONL to write (default data/reasoning-gym/TASK-seedS-N.jsonl)")
    q = sources.add_parser("reasoning-gym-steps", help="rows of several reasoning-gym tasks with worked, step-wise "
                           "solutions by a clean or sloppy teacher (plugins/reasoning_gym_steps.py)")
    q.add_argument("--tasks", required=True, help="comma-separated, e.g. chain_sum,spell_backward,count_bits")
    q.add_argument("--size", type=int, default=500, help="rows per task (default 500)")
    q.add_argument("--seed", type=int, default=0, help="the generator's seed (default 0)")
    q.add_argument("--teacher", choices=("clean", "sloppy"), default="clean", help="sloppy: one slip in half the "
                   "solutions, followed through (default clean)")
    q.add_argument("--exclude", action="append", default=[], metavar="JSONL", help="skip rows whose prompt is in this "
                   "file; repeatable")
    q.add_argument("--columns", help="comma-separated columns to keep (default all), e.g. prompt,completion,task "
                   "for an sft file")
    q.add_argument("--out", required=True, help="the JSONL to write")
