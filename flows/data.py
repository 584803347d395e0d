"""The bundled input data under `data/`, tracked by DVC in `data.dvc`."""

from __future__ import annotations

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
