"""alignflow.flows: Prefect flows and the stage tasks they chain.

From a notebook or a script: `run(pipeline, overrides, options=RunOptions(...)) -> RunResult` and
`validate(pipeline)`. For your own flows: `pipeline_flow` (the whole pipeline, usable as a subflow),
`open_session`, `submit_stages` and `stage_task` (submit a pipeline's stages inside your flow), and the
stage-runner contract `StageContext`, `StageResult`, `RUNNERS`. Imported lazily so the CLI's
quick commands never pay for importing Prefect.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run": "alignflow.flows.api",
    "validate": "alignflow.flows.api",
    "RunResult": "alignflow.flows.api",
    "RunOptions": "alignflow.flows.options",
    "pipeline_flow": "alignflow.flows.pipeline",
    "open_session": "alignflow.flows.plan",
    "submit_stages": "alignflow.flows.pipeline",
    "stage_task": "alignflow.flows.pipeline",
    "PipelineReport": "alignflow.flows.report",
    "StageContext": "alignflow.flows.stages",
    "StageResult": "alignflow.flows.stages",
    "RUNNERS": "alignflow.flows.stages.runners",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'alignflow.flows' has no attribute {name!r}")
