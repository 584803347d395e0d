"""A `StageContext` for one stage of a pipeline spec, as the pipeline would build it, without Prefect."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.stages import StageContext


def no_metrics(metrics: dict, step: int) -> None:
    """A metrics logger that drops what it is given."""


def stage_context(root: Path, spec: Any, name: str | None = None, *, settings_model: Any = None,
                  settings: Any = None, inputs: dict | None = None, seed: int = 0, log_metrics=no_metrics,
                  plugins: Any = None, work: str = "work", checkpoints: str = "checkpoints") -> StageContext:
    """The context of stage `name` (the first when None) of `spec` (a dict, a `PipelineSpec` or a `StageSpec`).

    Settings are `settings` when given, else `settings_model` validated from the stage's settings; inputs default
    to the stage's; the work folder is created under `root`, the checkpoint folder is not.
    """
    stage = spec
    if isinstance(spec, dict):
        spec = parse_spec(spec)
    if hasattr(spec, "stages"):
        name = name or next(iter(spec.stages))
        stage = spec.stages[name]
    if settings is None:
        settings = settings_model.model_validate(stage.settings)
    ctx = StageContext(name or "stage", stage, settings, dict(stage.inputs) if inputs is None else inputs,
                       Path(root) / work, Path(root) / checkpoints, seed, log_metrics,
                       get_plugins() if plugins is None else plugins)
    ctx.work_dir.mkdir(parents=True, exist_ok=True)
    return ctx
