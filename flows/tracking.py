"""MLflow records: one parent run per pipeline run, one nested run per stage.

Everything goes through an explicit `MlflowClient` (no fluent active-run state), so stage tasks
running in threads log to their own runs safely. Its calls run on a thread of their own
(`SignalSafeClient`), so that a signal never stops a store write half-way.
"""

from __future__ import annotations

import os
import queue
import re
import subprocess
import tempfile
import threading
import time
import weakref
from collections import defaultdict
from pathlib import Path
from typing import Any

from alignflow.flows.launch import shutdown

PARENT_TAG = "mlflow.parentRunId"
MAX_KEY_CHARS = 250  # MLflow's limit on metric, param and tag keys


def mlflow_key(name: str) -> str:
    """`name` as a key MLflow accepts: `pass@1` -> `pass_at_1`, other characters it rejects -> `_`.

    MLflow allows letters, digits, `_ - . /` and spaces, and no path that normalises to another name.
    """
    key = re.sub(r"[^\w.\- /]", "_", name.replace("@", "_at_"))[:MAX_KEY_CHARS]
    return "/".join(p if p.strip(".") else "_" for p in key.split("/") if p) or "_"


def tracking_uri(project: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else a SQLite file in the project."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{(project / 'mlflow.db').resolve()}"


def flatten(obj: Any, prefix: str = "") -> dict[str, str]:
    """{"a": {"b": 1}, "c": [2]} -> {"a.b": "1", "c.0": "2"}: MLflow params are flat strings."""
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list) and obj:
        items = enumerate(obj)
    else:
        return {prefix: str(obj)[:6000]} if prefix else {}
    out: dict[str, str] = {}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def fingerprint_tags(fingerprint: dict) -> dict[str, str]:
    """A stage's environment fingerprint as `alignflow.fp.*` tags (`alignflow.fp.cpu_capability`, ...)."""
    return flatten(fingerprint, "alignflow.fp")


def git_state(project: Path) -> dict[str, str]:
    """The commit and dirty flag of the project's git checkout; empty outside git."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=project, capture_output=True, text=True,
                              check=True).stdout.strip()
    try:
        return {"git.commit": git("rev-parse", "HEAD"),
                "git.dirty": str(bool(git("status", "--porcelain", "--untracked-files=no")))}
    except (OSError, subprocess.CalledProcessError):
        return {}


class SignalSafeClient:
    """An `MlflowClient` whose calls run one at a time on a daemon thread of its own; the caller waits.

    Signal handlers run in the main thread: Ctrl-C, or the SIGTERM with which a Prefect worker cancels a
    flow run (raised there as `TerminationSignal`). One that lands inside a SQLite store's write can
    leave that write's connection checked out with its transaction open: the store's write lock stays
    held, and closing the run as KILLED then fails after the 20 s busy timeout (the run is left RUNNING).
    Here the handler interrupts only the wait: the write finishes on its thread, and the next call
    (closing the run) runs after it. The queue and the wait are safe to re-enter from a handler.
    """

    def __init__(self, client):
        self._client = client
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(self._jobs,), name="mlflow-client", daemon=True).start()
        weakref.finalize(self, self._jobs.put, None)  # the thread ends with its client

    def __getattr__(self, name: str):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            answer: queue.SimpleQueue = queue.SimpleQueue()
            self._jobs.put((attr, args, kwargs, answer))
            ok, value = answer.get()
            if not ok:
                raise value
            return value

        return call


def _serve(jobs: queue.SimpleQueue) -> None:
    while (job := jobs.get()) is not None:
        method, args, kwargs, answer = job
        try:
            answer.put((True, method(*args, **kwargs)))
        except BaseException as exc:  # handed to the caller, raised there
            answer.put((False, exc))


class Tracker:
    """The MLflow side of one pipeline run."""

    def __init__(self, project: Path, experiment: str, guard: shutdown.RunGuard | None = None):
        from mlflow.tracking import MlflowClient

        self.guard = shutdown.RunGuard() if guard is None else guard  # the run's: a stop closes what is open
        self.uri = tracking_uri(project)
        self.client = SignalSafeClient(MlflowClient(self.uri))
        found = self.client.get_experiment_by_name(experiment)
        if found is not None:
            self.experiment_id = found.experiment_id
        else:
            # A local store keeps artifacts beside the database, not in the current directory.
            location = (project / "mlruns").resolve().as_uri() if self.uri.startswith("sqlite") else None
            self.experiment_id = self.client.create_experiment(experiment, artifact_location=location)
        self.parent_id: str | None = None

    def start_pipeline(self, name: str, params: dict, tags: dict[str, str], files: dict[str, str]) -> str:
        """Open the parent run; `files` {artifact name: text} records the spec and data.dvc."""
        shutdown.close_dead_runs(self.client, self.experiment_id)  # runs a killed attempt left RUNNING
        run = self.client.create_run(self.experiment_id, run_name=name, tags={**tags, **shutdown.owner_tags()})
        self.parent_id = run.info.run_id
        self.guard.open_runs[self.parent_id] = self.client
        self._log(self.parent_id, params=flatten(params))
        for artifact, text in files.items():
            self.client.log_text(self.parent_id, text, artifact)
        return self.parent_id

    def end_pipeline(self, failed: bool, metrics: dict[str, float]) -> None:
        self._log(self.parent_id, metrics=metrics)
        self.client.set_terminated(self.parent_id, "FAILED" if failed else "FINISHED")
        self.guard.open_runs.pop(self.parent_id, None)

    def stage_run(self, stage: str, params: dict, tags: dict[str, str]) -> StageRun:
        """A nested run under the parent for one stage."""
        run = self.client.create_run(self.experiment_id, run_name=stage,
                                     tags={**tags, PARENT_TAG: self.parent_id, **shutdown.owner_tags()})
        self.guard.open_runs[run.info.run_id] = self.client
        self._log(run.info.run_id, params=flatten(params))
        return StageRun(self, run.info.run_id)

    def register_model(self, name: str, folder: Path | str, run_id: str) -> str:
        """A new version of the registered model `name`, pointing at the (immutable) artifact folder or URL."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.create_registered_model(name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
        source = folder if isinstance(folder, str) else folder.resolve().as_uri()
        version = self.client.create_model_version(name, source=source, run_id=run_id)
        return version.version

    def _log(self, run_id: str, params: dict | None = None, metrics: dict | None = None,
             step: int = 0, tags: dict | None = None) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        # Keys come from plugins and configs: one MLflow rejects must not crash the stage.
        self.client.log_batch(
            run_id,
            metrics=[Metric(mlflow_key(k), float(v), now, step) for k, v in (metrics or {}).items()],
            params=[Param(mlflow_key(k), v) for k, v in (params or {}).items()],
            tags=[RunTag(mlflow_key(k), str(v)) for k, v in (tags or {}).items()],
        )


class StageRun:
    """One stage's nested run: step metrics as they come, then the outcome, manifest and plots."""

    def __init__(self, tracker: Tracker, run_id: str):
        self.tracker, self.run_id = tracker, run_id
        self.curves: dict[str, list[tuple[int, float]]] = defaultdict(list)
        self._lock = threading.Lock()

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """The `StageContext.log_metrics` callback."""
        with self._lock:
            for key, value in metrics.items():
                self.curves[key].append((step, float(value)))
        self.tracker._log(self.run_id, metrics=metrics, step=step)

    def finish(self, status: str, metrics: dict[str, float], tags: dict[str, str],
               manifest: Path | None) -> None:
        """Final metrics and tags, the manifest and curve plots as artifacts; closes the run."""
        self.tracker._log(self.run_id, metrics=metrics, tags={**tags, "alignflow.status": status},
                          step=max((s for c in self.curves.values() for s, _ in c), default=0))
        if manifest is not None and manifest.is_file():
            self.tracker.client.log_artifact(self.run_id, str(manifest))
        curves = {k: v for k, v in self.curves.items() if len(v) > 1}
        if curves:
            self._log_plots(curves)
        self.tracker.client.set_terminated(self.run_id, "FAILED" if status == "failed" else "FINISHED")
        self.tracker.guard.open_runs.pop(self.run_id, None)

    def _log_plots(self, curves: dict[str, list[tuple[int, float]]]) -> None:
        import matplotlib

        matplotlib.use("Agg")  # no display: plots are files
        import matplotlib.pyplot as plt

        with tempfile.TemporaryDirectory() as tmp:
            for key, points in curves.items():
                fig, ax = plt.subplots(figsize=(5, 3.2))
                ax.plot([s for s, _ in points], [v for _, v in points], marker=".")
                ax.set_xlabel("step")
                ax.set_ylabel(key)
                ax.grid(alpha=0.3)
                fig.tight_layout()
                path = Path(tmp) / f"{key.replace('/', '_')}.png"
                fig.savefig(path, dpi=100)
                plt.close(fig)
                self.tracker.client.log_artifact(self.run_id, str(path), "plots")
