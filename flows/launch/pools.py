"""Stages on Prefect work pools: a stage with a `pool` runs as a flow run of `stage_flow` on that pool.

Each pool gets a deployment of `stage_flow` (`alignflow-stage/POOL`, created or updated when a stage
is sent there). The pipeline's stage task starts a flow run of it with `run_deployment`, waits for it
and reads the finished manifest from the artifact store, which both machines must see (on one machine:
the same folder). The worker's flow run rebuilds the session from the pipeline's resolved spec text
and runs `execute_stage` for that one stage: the manifest cache, the stage lock, checkpoints and
resume, and the MLflow child run are the same code as in the pipeline's own process. A worker killed
mid-stage (its machine gone) stops heartbeating: the pipeline sets its flow run Crashed and fails the
stage by name; the stage's checkpoints stay, and the next run of the pipeline resumes from them. A
pipeline stopped by SIGINT/SIGTERM sets its stages' flow runs Cancelling (flows/launch/shutdown.py): the worker
SIGTERMs the flow run, whose stage unwinds (its lock released, its checkpoints kept, nothing published).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from prefect import flow
from prefect.exceptions import TerminationSignal
from prefect.states import Completed, State

from alignflow.flows.launch import shutdown
from alignflow.flows.options import POOL_TIMEOUT_ENV, Nodes, RunOptions

if TYPE_CHECKING:  # these import torch: see below
    from alignflow.flows.launch.execute import StageOutcome
    from alignflow.flows.plan import Session, StagePlan

# The stage machinery (torch and all: flows.execute, flows.plan) is imported in the functions that run
# stages: a worker loads this module without it to run a cancelled flow run's hooks, so a cancelled stage
# is Cancelled 15 s sooner.
log = logging.getLogger(__name__)

STAGE_FLOW = "alignflow-stage"
POLL_S = 1.0
PLUGINS_ENV = "ALIGNFLOW_PLUGINS"  # core/plugins.py reads it in every process, the worker's flow run too
_deploy_lock = threading.Lock()


@flow(name=STAGE_FLOW, persist_result=False)
def stage_flow(spec: str, source: str, stage: str, digest: str, project: str, artifacts: str,
               mlflow_parent: str | None = None, options: dict | None = None) -> State:
    """Run one stage of a pipeline on this worker; `spec` is the pipeline's resolved spec text, `options`
    its `RunOptions.as_dict()` (None: read from this worker's environment)."""
    from alignflow.flows.launch.execute import STATE_NAMES, StageFailed, execute_stage  # torch: see above
    from alignflow.flows.plan import open_session  # torch: see above

    run_options = RunOptions.from_env() if options is None else RunOptions.from_dict(options)
    with tempfile.TemporaryDirectory(prefix="alignflow-stage-") as tmp:
        path = Path(tmp) / Path(source).name  # errors name the pipeline's file, not a temp name
        path.write_text(spec)
        session = open_session(path, [], Path(project), artifacts, run_options)
    plan = session.plans[stage]
    if plan.digest != digest:
        raise StageFailed(f"stage {stage!r}: this worker computes digest {plan.digest[:12]}, the pipeline "
                          f"{digest[:12]}: its alignflow, plugins or input files differ from the pipeline "
                          "machine's (install the same versions; keep the project on a shared path)")
    upstream = {name: finished(session, name, stage) for name in sorted(set(plan.upstream.values()))}
    session.tracker.parent_id = mlflow_parent  # the stage's MLflow run nests under the pipeline's
    try:
        outcome = execute_stage(plan, upstream, session.store, session.tracker, session.plugins, session.launcher)
    except TerminationSignal:  # cancelled: the worker's SIGTERM, raised here by Prefect; the lock is free
        session.guard.close_open_runs()  # the stage's MLflow run, KILLED rather than left RUNNING
        raise
    return Completed(name=STATE_NAMES.get(outcome.status, "Completed"),
                     message=f"stage {stage!r} {outcome.status} in {outcome.seconds:.1f} s")


def finished(session: Session, name: str, reader: str | None = None, status: str = "cached",
             seconds: float = 0.0) -> StageOutcome:
    """Stage `name`'s outcome from its manifest in the artifact store; `reader`: the stage that needs it."""
    from alignflow.flows.launch.execute import StageFailed, StageOutcome  # torch: see above

    plan = session.plans[name]
    manifest = session.store.manifest(name, plan.digest)
    if manifest is None:
        who = f"stage {reader!r}: its input stage {name!r}" if reader else f"stage {name!r}"
        raise StageFailed(f"{who} has no finished artifact {plan.digest[:12]} in {session.store.location}: "
                          "does this machine see the pipeline's artifact store?")
    return StageOutcome(name, plan.kind, status, seconds, plan.digest, session.store.folder(name, plan.digest),
                        session.store.outputs(manifest, name), manifest["metrics"], manifest.get("headline"),
                        manifest.get("mlflow_run_id"))


def ensure_process_pool(name: str) -> None:
    """Create the work pool as a `process` pool (no Docker) unless it exists."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        with contextlib.suppress(ObjectAlreadyExists):
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))


def deploy_stage_flow(pool: str) -> str:
    """Create the process pool unless it exists and create or update `stage_flow`'s deployment on it."""
    from prefect.deployments.runner import EntrypointType

    with _deploy_lock:
        ensure_process_pool(pool)
        # A module entrypoint: the worker imports the installed alignflow, so no code storage is needed.
        stage_flow.to_deployment(pool, work_pool_name=pool, entrypoint_type=EntrypointType.MODULE_PATH,
                                 description=f"alignflow stages sent to work pool {pool!r}").apply()
    return f"{STAGE_FLOW}/{pool}"


def run_on_pool(pool: str, session: Session, plan: StagePlan) -> StageOutcome:
    """Run `plan` as a flow run on `pool`, wait for it, and return its outcome read from its manifest."""
    from prefect import get_client
    from prefect.deployments import run_deployment
    from prefect.runtime import flow_run

    from alignflow.flows.launch.execute import STATE_NAMES, StageFailed  # torch: see above

    deployment = deploy_stage_flow(pool)
    session.guard.sending_to_pool()  # a stop from here on finds the flow run by its tag and cancels it
    # What the worker needs to plan the same digest and log where the pipeline logs: the run's options
    # (--nproc and the like), the plugins it loads and the MLflow store. Not where this run's nodes meet:
    # a stage on a pool runs its ranks on the worker's machine.
    options = dataclasses.replace(session.options, nodes=Nodes())
    env = {"MLFLOW_TRACKING_URI": session.tracker.uri}  # the worker process's environment, not this one's
    if PLUGINS_ENV in os.environ:
        env[PLUGINS_ENV] = os.environ[PLUGINS_ENV]
    run = run_deployment(
        deployment, timeout=0, as_subflow=False, flow_run_name=f"{session.spec.name}.{plan.name}",
        parameters={"spec": session.spec_text, "source": flow_run.parameters.get("pipeline", "pipeline.yaml"),
                    "stage": plan.name, "digest": plan.digest, "project": str(session.project),
                    "artifacts": session.store.location, "mlflow_parent": session.tracker.parent_id,
                    "options": options.as_dict()},
        tags=[f"alignflow.pipeline:{session.spec.name}", shutdown.pipeline_run_tag(flow_run.get_id())],
        job_variables={"env": env},
    )
    log.info("stage %r: flow run %s (%s) on work pool %r", plan.name, run.name, run.id, pool)
    # A stopped pipeline cancels it (flows/launch/shutdown.py): its worker kills it, its checkpoints stay
    with get_client(sync_client=True) as client:
        run = wait_for_run(client, run, pool, plan.name, options.pool_timeout_s)
    state = run.state
    if not state.is_completed():
        failed = StageFailed(f"{shutdown.pool_label(plan.name, pool, run.name, run.id)} "
                             f"{state.name}: {state.message or 'no message'}")
        failed.seconds = run.total_run_time.total_seconds()
        raise failed
    status = {v: k for k, v in STATE_NAMES.items()}.get(state.name, "ran")  # Cached, Resumed; else ran
    outcome = finished(session, plan.name, status=status, seconds=run.total_run_time.total_seconds())
    if status != "cached":  # the runner's own time, as for a stage run here
        manifest = session.store.manifest(plan.name, plan.digest)
        outcome.seconds = manifest["timings"]["seconds"]
    return outcome


def wait_for_run(client, run, pool: str, stage: str, timeout: float):
    """The flow run once final. A run that no worker takes within `timeout` seconds is cancelled and
    the stage fails naming the pool; once a worker has it, it may run as long as it needs, as long as
    that worker lives: a run whose worker stops heartbeating (see `WorkerWatch`) is set Crashed."""
    from prefect.states import Cancelled

    from alignflow.flows.launch.execute import StageFailed  # torch: see above

    started = time.monotonic()
    watch = WorkerWatch(pool)
    while True:
        run = client.read_flow_run(run.id)
        if run.state is not None and run.state.is_final():
            return run
        if run.state is not None and run.state.is_scheduled() and time.monotonic() - started > timeout:
            answer = client.set_flow_run_state(run.id, Cancelled(message=f"no worker on pool {pool!r}"))
            if answer.status.value == "ACCEPT":  # else a worker took it meanwhile: keep waiting
                online = [w.name for w in client.read_workers_for_work_pool(pool)
                          if getattr(w.status, "value", w.status) == "ONLINE"]
                raise StageFailed(
                    f"stage {stage!r}: no worker of work pool {pool!r} took its flow run {run.name} within "
                    f"{timeout:g} s ({POOL_TIMEOUT_ENV}); the pool has "
                    f"{len(online)} online worker{'s' if len(online) != 1 else ''}. Start one where the "
                    f"stage should run: prefect worker start --pool {pool}")
        elif run.state is not None and not run.state.is_scheduled() and (gone := watch.gone(client, run)):
            crash_run(client, run, gone)  # then the next read returns it final and the stage fails
            continue
        time.sleep(POLL_S)


# Prefect's foreman marks a worker OFFLINE after this many missed heartbeats (its
# inactivity_heartbeat_multiple default); a worker's heartbeat loop jitters each interval by up to 30 %.
MISSED_BEATS = 3
HEARTBEAT_JITTER = 1.3


class WorkerWatch:
    """Tells when the worker that took a flow run is gone (its machine died, or it was killed).

    A worker labels each flow run it takes `prefect.worker.name` before it starts it, and heartbeats
    every `heartbeat_interval_seconds` (PREFECT_WORKER_HEARTBEAT_SECONDS, default 30) while it lives.
    A process worker's flow run is its child process, so the run lives no longer than its worker. The
    worker counts as gone when the server's `last_heartbeat_time` for it has not changed for
    MISSED_BEATS x 1.3 x its interval, timed on this machine's monotonic clock (no comparison of two
    machines' clocks), or when the pool no longer lists it after as long. A worker that heartbeats is
    never judged gone, however long its stage runs.
    """

    def __init__(self, pool: str, clock=time.monotonic):
        self.pool = pool
        self.clock = clock
        self.seen: dict[str, tuple] = {}  # worker name -> (last heartbeat, when it changed, its interval)

    def gone(self, client, run) -> str | None:
        """A message naming the worker and how long it has been silent, or None while it lives."""
        name = (run.labels or {}).get("prefect.worker.name")
        if not name:  # not taken by a worker yet (or by one that does not label its runs)
            return None
        worker = next((w for w in client.read_workers_for_work_pool(self.pool) if w.name == name), None)
        now = self.clock()
        last, since, interval = self.seen.get(name, (None, now, None))
        if worker is not None:  # else judged by the interval it last reported, or Prefect's default
            interval = worker.heartbeat_interval_seconds
        interval = interval or 30
        beat = worker.last_heartbeat_time if worker is not None else None
        if name not in self.seen or beat != last:
            self.seen[name] = (beat, now, interval)
            return None
        silent = now - since
        if silent <= MISSED_BEATS * HEARTBEAT_JITTER * interval:
            return None
        what = "is no longer registered" if worker is None else f"sent no heartbeat for {silent:.0f} s"
        return (f"worker {name!r} of work pool {self.pool!r} {what} (it beats every {interval} s): "
                "its machine or process is gone")


def crash_run(client, run, message: str) -> None:
    """Set `run` Crashed with `message`, unless it reached a final state meanwhile."""
    from prefect.states import Crashed

    answer = client.set_flow_run_state(run.id, Crashed(message=message))
    if answer.status.value != "ACCEPT":  # the server refused: force it unless the run finished itself
        current = client.read_flow_run(run.id)
        if current.state is None or not current.state.is_final():
            client.set_flow_run_state(run.id, Crashed(message=message), force=True)
    log.warning("flow run %s (%s): %s; set Crashed", run.name, run.id, message)
