"""Everything about a pipeline that can be checked before compute, checked at once and reported together.

The YAML, the spec (every stage's plugins, configs and settings), the input paths (a path-like input
that does not exist is an error, not a hub id) and every row of the local JSONL datasets the stages
read (valid JSON, the fields the stage needs). `alignflow validate` and `alignflow run` call this
before Prefect's server or any model starts; it imports neither Prefect nor MLflow.

Two passes: the first (YAML, stage shapes, settings, inputs, rows) loads no plugin code, hence no torch,
and its problems can be shown at once (`early`); the second loads the plugins and checks their configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from alignflow.core.task.constitution import constitution_problems
from alignflow.core.train.datasets import check_row
from alignflow.core.errors import SpecError
from alignflow.core.spec.kinds import stage_kind
from alignflow.core.spec.schema import PipelineSpec, parse_shape, read_yaml, resolve_stages, stages_of
from alignflow.core.spec.stage import ResolvedStage, resolve_input
from alignflow.flows.overrides import apply_overrides

SHOWN_PER_FILE = 10  # bad lines listed per file; the rest are counted


@dataclass(frozen=True)
class CheckedSpec:
    """A pipeline as `check_pipeline` accepted it, handed to the run so that nothing is read or validated twice."""

    spec: PipelineSpec
    raw: dict  # the YAML with the overrides applied: what `reproduce` reruns
    stages: dict[str, ResolvedStage]  # each stage of `spec.stages` (a loop's every round) resolved


def jsonl_problems(path: Path, schema: str | None) -> list[str]:
    """`file:line: problem` for each bad row (the first SHOWN_PER_FILE, then a count); no rows is one."""
    import json

    problems, bad, rows = [], 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            rows += 1
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                problem = f"invalid JSON: {exc.msg} (column {exc.colno})"
            else:
                problem = check_row(row, schema) if schema else (
                    None if isinstance(row, dict) else f"expected a JSON object, got {type(row).__name__}")
            if problem:
                bad += 1
                if bad <= SHOWN_PER_FILE:
                    problems.append(f"{path}:{line_no}: {problem}")
    if bad > SHOWN_PER_FILE:
        problems.append(f"{path}: {bad - SHOWN_PER_FILE} more bad lines")
    if rows == 0:
        problems.append(f"{path}: empty dataset: no rows")
    return problems


def bundled(value: str, project: Path) -> bool:
    """A bundled dataset (`data/<name>.jsonl`) that is missing: `alignflow run` writes it at the start."""
    from alignflow.core.task.arithmetic import SIZES
    from alignflow.flows.data import DATA_DIR

    path = Path(value)
    return path.parts[:1] == (DATA_DIR,) and path.name in {f"{n}.jsonl" for n in SIZES} \
        and len(path.parts) == 2 and not (project / path).exists()


def input_problems(spec: PipelineSpec, project: Path, plugins, stages: set[str] | None = None,
                   rows_only: bool = False) -> list[str]:
    """Missing path-like inputs and bad rows of local JSONL datasets, over every stage (or `stages`);
    `rows_only`: the datasets' rows alone. Without `plugins`, the rows of preference stages and of stages
    with an environment are left out."""
    problems, checked, seen = [], set(), set()
    for name in spec.order():
        stage, label = spec.stages[name], spec.label(name)  # a loop's rounds: one label, one report
        if stages is not None and name not in stages:
            continue
        references, kind = stage.references(), stage_kind(stage.kind)
        for field, value in sorted(stage.inputs.items()):
            if field in kind.inputs and kind.inputs[field] is None and field in references and not rows_only:
                problems.append(f"stage {label!r}, inputs.{field}: {value!r}: expected a text file of principles, "
                                "not a stage's output")
                continue
            if field in references or bundled(value, project) or (rows_only and field != "dataset"):
                continue
            if (label, field, value) in seen:
                continue
            seen.add((label, field, value))
            try:
                resolved = resolve_input(value, project)
            except SpecError as exc:
                if not rows_only:  # reported by the first pass
                    problems.append(f"stage {label!r}, inputs.{field}: {exc}")
                continue
            if field == "constitution":
                problems += [f"stage {label!r}, inputs.{field}: {p}" for p in constitution_problems(resolved)]
                continue
            if not isinstance(resolved, Path) or resolved.suffix != ".jsonl" or not resolved.is_file():
                continue
            if field == "dataset" and kind.needs_plugins(stage) and plugins is None:
                continue
            # the rows its kind's record names (core/spec/kinds.py; some follow the algorithm); None: any JSON objects
            schema = kind.dataset_schema(stage, plugins) if field == "dataset" else None
            if (resolved, schema) not in checked:
                checked.add((resolved, schema))
                problems += [f"stage {label!r}, inputs.{field}: {p}" for p in jsonl_problems(resolved, schema)]
    return problems


def check_pipeline(pipeline: Path, overrides: list[str] = (), project: Path = Path("."),
                   plugins=None, regenerate: bool = False, early=None) -> CheckedSpec:
    """The checked spec, or one SpecError listing every problem found. `regenerate`: write the
    bundled datasets under `data/` first when a stage reads them and they are missing (as a run does);
    without it they are taken as present. `early(problems)`, if given, is called with the problems found
    before any plugin code loads (in about a second); the SpecError then lists only the others."""
    source = str(pipeline)
    raw = apply_overrides(read_yaml(Path(pipeline)), list(overrides))
    spec, problems = parse_shape(raw, source)
    misshapen = stages_of(problems)  # their plugins are not checked: one problem per stage's spec
    if regenerate:  # what `alignflow run` would write at its start, written now so its rows are checked too
        from alignflow.flows.data import ensure_data

        ensure_data(spec, project)
    problems += input_problems(spec, project, None)
    shown = len(problems) if early is not None and problems else 0
    if shown:
        early(list(problems))
    if plugins is None:
        from alignflow.core.plugins import get_plugins

        plugins = get_plugins()
    resolved, with_plugins = resolve_stages(spec, source, plugins, skip=misshapen)
    problems += with_plugins + cost_reward_problems(spec, source, resolved, misshapen | stages_of(with_plugins))
    # Rows that follow the stage's algorithm (pairs or labelled rows) or, for episodes, what its rewards read:
    # checked once they are loaded.
    by_algorithm = {name for name, stage in spec.stages.items()
                    if stage_kind(stage.kind).needs_plugins(stage) and spec.label(name) not in misshapen}
    problems += input_problems(spec, project, plugins, by_algorithm, rows_only=True)
    raise_all(pipeline, problems, shown)
    return CheckedSpec(spec, raw, resolved)


def cost_reward_problems(spec: PipelineSpec, source: str, resolved: dict[str, ResolvedStage],
                         skip: set[str]) -> list[str]:
    """Each stage whose algorithm's `cost_reward` is not one of its rewards, or has a weight other than 0
    (the stage checks it again as it builds); stages in `skip` already have a problem reported."""
    from alignflow.core.rl.algorithm import cost_reward_problem

    problems, seen = [], set(skip)
    for name, stage in spec.stages.items():
        label = spec.label(name)  # a loop's rounds: checked once
        use = resolved.get(name) if label not in seen else None
        seen.add(label)
        if use is None or use.algorithm is None or not hasattr(use.algorithm.obj, "cost_reward"):
            continue
        problem = cost_reward_problem(use.algorithm.build(), stage.rewards)
        if problem:
            problems.append(f"{source}: stage {label!r}, {problem}")
    return problems


def raise_all(pipeline: Path, problems: list[str], shown: int) -> None:
    """One SpecError with the problems not shown yet (all of them when none were)."""
    if not problems:
        return
    rest = problems[shown:]
    count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''} found before any compute"
    if not rest:
        raise SpecError(f"{pipeline}: {count} (listed above)")
    head = f"{count}; {len(rest)} more" if shown else count
    raise SpecError(f"{pipeline}: {head}:\n" + "\n".join(f"  {p}" for p in rest))
