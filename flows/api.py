"""Run and validate pipelines from Python (notebooks, scripts): what `alignflow run --json` and `validate` give.

    from alignflow.flows import RunOptions, run
    result = run("pipelines/r1-tiny.yaml", ["sft.settings.max_steps=5"],
                 options=RunOptions(nproc=2))
    result.statuses, result.metrics["sft"], result.artifacts["sft"]

A pipeline is a YAML file or the same spec as a dict; `options=None` reads the ALIGNFLOW_* variables
(`RunOptions.from_env()`), as the command line does.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from alignflow.flows.launch import shutdown
from alignflow.flows.launch.nodes import hosting
from alignflow.flows.options import RunOptions
from alignflow.flows.preflight import CheckedSpec, check_pipeline
from alignflow.flows.report import PipelineReport

Pipeline = str | Path | Mapping[str, Any]
Overrides = list[str] | Mapping[str, Any] | None


@dataclass(frozen=True)
class RunResult:
    """A finished run: each stage's status, final metrics and artifact folder, and the run ids."""

    report: PipelineReport  # the run's report, as `alignflow run` prints it (`render`, `as_json`)

    @property
    def statuses(self) -> dict[str, str]:
        """{stage: ran | cached | resumed | failed | skipped}."""
        return {s.name: s.status for s in self.report.stages}

    @property
    def metrics(self) -> dict[str, dict[str, float]]:
        """{stage: its final metrics}."""
        return {s.name: s.metrics for s in self.report.stages}

    @property
    def artifacts(self) -> dict[str, Path | None]:
        """{stage: its artifact folder `<root>/<stage>/<digest>/` (outputs under `out/`), None when it did not finish}."""
        return {s.name: Path(s.artifact) if s.artifact else None for s in self.report.stages}

    @property
    def ok(self) -> bool:
        return not self.report.failed

    def as_dict(self) -> dict:
        """What `alignflow run --json` prints, as a dict."""
        return json.loads(self.report.as_json())


def run(pipeline: Pipeline, overrides: Overrides = None, *, project: str | Path | None = None,
        artifacts: str | Path | None = None, options: RunOptions | None = None) -> RunResult:
    """Run a pipeline (a YAML path or a spec dict) with `overrides` (["STAGE.FIELD=VALUE"] or
    {"STAGE.FIELD": value}); finished stages are reused. Relative inputs are relative to `project`
    (default: the working directory), artifacts go to `artifacts` (default: `<project>/artifacts`)."""
    root = Path(project or Path.cwd()).resolve()
    options = RunOptions.from_env() if options is None else options
    with spec_file(pipeline) as path:
        report = run_checked(path, override_list(overrides), root, artifacts, options)
    if not isinstance(report, PipelineReport):
        raise ValueError(f"options.nodes.rank={options.nodes.rank}: only node 0 of a run returns its result; "
                         "run the other nodes with `alignflow run`")
    return RunResult(report)


def validate(pipeline: Pipeline, overrides: Overrides = None, *, project: str | Path | None = None) -> CheckedSpec:
    """The checked spec (`.spec`, and each stage's settings and plugin configs as values in `.stages`), as
    `alignflow validate` checks it; a SpecError lists every problem."""
    with spec_file(pipeline) as path:
        return check_pipeline(path, override_list(overrides), Path(project or Path.cwd()).resolve())


def run_checked(pipeline: Path, overrides: list[str], project: Path, artifacts, options: RunOptions,
                early=None) -> PipelineReport | dict[str, str]:
    """Check the spec before Prefect or a model starts (`early`: preflight's), then run it under the signal
    guard: node 0's report, or on another node, which follows node 0 and lends it its ranks
    (flows/launch/follow.py), {stage: how it went there}."""
    checked = check_pipeline(pipeline, overrides, project, regenerate=True, early=early)
    with shutdown.guarded() as guard:  # SIGINT/SIGTERM: all stopped and closed; SIGKILL: a watchdog cleans up
        if options.nodes.rank > 0:
            from alignflow.flows.launch.follow import follow_pipeline  # torch: not for the CLI's quick commands

            return follow_pipeline(checked, project, artifacts, options)
        from alignflow.flows.pipeline import run_pipeline  # Prefect and torch: not for the quick commands

        with hosting(options.nodes):
            return run_pipeline(pipeline, overrides, project, artifacts, options, checked, guard)


def override_list(overrides: Overrides) -> list[str]:
    """["STAGE.FIELD=VALUE"] from a list of them or a {"STAGE.FIELD": value} dict (values as YAML)."""
    if overrides is None:
        return []
    if isinstance(overrides, Mapping):
        return [f"{key}={json.dumps(value)}" for key, value in overrides.items()]
    return list(overrides)


@contextlib.contextmanager
def spec_file(pipeline: Pipeline) -> Iterator[Path]:
    """A path to the spec: the file given, or a dict written as YAML to a temporary `<name>.yaml`."""
    if not isinstance(pipeline, Mapping):
        yield Path(pipeline)
        return
    with tempfile.TemporaryDirectory(prefix="alignflow-spec-") as tmp:
        path = Path(tmp) / f"{pipeline.get('name') or 'pipeline'}.yaml"
        path.write_text(yaml.safe_dump(dict(pipeline), sort_keys=False))
        yield path
