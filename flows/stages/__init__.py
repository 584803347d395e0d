"""The stage-runner contract: what the pipeline gives a stage, and what a stage gives back.

A runner is `run(ctx: StageContext) -> StageResult`, registered in `registry.RUNNERS` under its stage kind.
It writes its outputs under `ctx.work_dir` and its resumable state under `ctx.checkpoint_dir`; the
pipeline owns digests, locking, the manifest, MLflow and Prefect, so a runner never touches them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from alignflow.core.contracts import PluginConfig
from alignflow.core.errors import SpecError
from alignflow.core.spec.kinds import OUTPUT_OF_INPUT, OUTPUTS  # noqa: F401  OUTPUT_OF_INPUT: read by flows/launch/execute.py
from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.stage import ResolvedStage, resolve_stage
from alignflow.flows.options import RunOptions

MetricsLogger = Callable[[dict[str, float], int], None]


@dataclass
class StageContext:
    """Everything a runner needs; inputs are local paths, or hub ids left as strings."""

    name: str
    spec: StageSpec
    settings: PluginConfig  # the kind's settings model, validated, defaults filled in
    inputs: dict[str, Path | str]
    work_dir: Path  # empty at start; outputs go here and are finalised by the pipeline
    checkpoint_dir: Path  # survives an interrupted run: resume from what is here
    seed: int  # settings.seed when given, else the pipeline's seed
    log_metrics: MetricsLogger  # (metrics, step) -> MLflow, and the step curves of the summary
    plugins: Any  # alignflow.core.plugins.Plugins
    resolved: ResolvedStage | None = None  # its blocks as the pipeline's check validated them; None: from `spec`
    world: int = 1  # the data-parallel processes (ranks) the stage runs on, all nodes together
    options: RunOptions = field(default_factory=RunOptions.from_env)  # the run's (built by hand: the environment's)

    def __post_init__(self):
        if self.resolved is None:  # a context built by hand, or rebuilt from plain data in a child process
            self.resolved = resolve_stage(self.spec, self.plugins, f"stage {self.name!r}", self.settings)

    def resuming(self) -> bool:
        """True when an interrupted run left checkpoints to resume from."""
        return self.checkpoint_dir.is_dir() and any(self.checkpoint_dir.iterdir())


@dataclass
class StageResult:
    """What a runner returns: `outputs` {"model"|"dataset": path under work_dir}, final metrics."""

    outputs: dict[str, Path]
    metrics: dict[str, float] = field(default_factory=dict)
    headline: str | None = None  # the metric the summary shows for this stage
    # entries only the run learns for the manifest's `fingerprint` (core/fingerprint.py): a training stage's
    # resolved precision (`Engine.fingerprint()`)
    fingerprint: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.outputs) - OUTPUTS
        if unknown:
            raise SpecError(f"a stage output must be 'model' or 'dataset', got {', '.join(sorted(unknown))}")
        if self.headline is not None and self.headline not in self.metrics:
            raise SpecError(f"headline metric {self.headline!r} is not among the metrics {sorted(self.metrics)}")


Runner = Callable[[StageContext], StageResult]
