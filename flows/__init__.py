"""alignflow.flows: Prefect flows and the stage tasks they chain.

From a notebook or a script: `run(pipeline, overrides, options=RunOptions(...)) -> RunResult` and
`validate(pipeline)`. For your own flows: `pipeline_flow` (the whole pipeline, usable as a subflow),
`open_session`, `submit_stages` and `stage_task` (submit a pipeline's stages inside your flow), and the
stage-runner contract `StageContext`, `StageResult`, `RUNNERS`. Imported lazily so the CLI's
quick commands never pay for importing Prefect.
"""

from __future__ import annotations

import importlib

_EXPORTS = {name: module for module, names in {
    "alignflow.flows.api": "run validate RunResult",
    "alignflow.flows.options": "RunOptions",
    "alignflow.flows.pipeline": "pipeline_flow submit_stages stage_task",
    "alignflow.flows.plan": "open_session",
    "alignflow.flows.report": "PipelineReport",
    "alignflow.flows.stages": "StageContext StageResult",
    "alignflow.flows.stages.runners": "RUNNERS",
}.items() for name in names.split()}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'alignflow.flows' has no attribute {name!r}")
