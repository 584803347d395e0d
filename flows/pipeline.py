"""The pipeline flow: one Prefect task per stage, submitted in dependency order.

A stage waits for the stages it reads from; independent stages run concurrently. A failed stage
stops its descendants only. A stage whose artifact is finished ends in a `Cached` state.
"""

from __future__ import annotations

import time
from pathlib import Path

from prefect import flow, task
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture, wait
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from prefect.utilities.annotations import quote

from alignflow.flows.prefect_server import start_temporary_server
from alignflow.flows.launch import shutdown
from alignflow.flows.digest import data_version
from alignflow.flows.launch.execute import STATE_NAMES, StageOutcome, execute_stage
from alignflow.flows.options import RunOptions
from alignflow.flows.plan import Session, StagePlan, open_session
from alignflow.flows.preflight import CheckedSpec, check_pipeline
from alignflow.flows.launch.pools import run_on_pool
from alignflow.flows.store.url import is_url
from alignflow.flows.report import PipelineReport, StageReport
from alignflow.flows.tracking import git_state


@task(cache_policy=NO_CACHE, persist_result=False, task_run_name="{name}")
def stage_task(name: str, session: Session, upstream: dict[str, PrefectFuture]) -> StageOutcome:
    """Run one stage, or reuse its finished artifact; `upstream` futures are all completed."""
    outcomes = {stage: future.result() for stage, future in upstream.items()}
    plan, pool = session.plans[name], session.spec.pool_of(name)
    if pool is not None and session.store.manifest(name, plan.digest) is None:
        outcome = run_on_pool(pool, session, plan)  # a worker of `pool` runs it (flows/launch/pools.py)
    else:
        outcome = execute_stage(plan, outcomes, session.store, session.tracker, session.plugins, session.launcher)
    if outcome.status in STATE_NAMES:
        return Completed(name=STATE_NAMES[outcome.status], data=outcome)
    return outcome


def submit_stages(session: Session) -> dict[str, PrefectFuture]:
    """Submit every stage, each waiting for its upstream stages; call inside a flow."""
    futures: dict[str, PrefectFuture] = {}
    for name in session.spec.order():
        upstream = {s: futures[s] for s in sorted(set(session.plans[name].upstream.values()))}
        # Quoted, so Prefect names the run before it finds a failed upstream in `wait_for`: a
        # skipped stage keeps its own name instead of `stage_task-xxx`.
        futures[name] = stage_task.submit(name, session, quote(upstream), wait_for=list(upstream.values()))
    return futures


def stage_report(plan: StagePlan, state: State) -> StageReport:
    """A stage's line in the summary, read from its final Prefect state."""
    if state.is_completed():
        o: StageOutcome = state.result()
        return StageReport(o.name, o.kind, o.status, o.seconds, o.metrics, o.headline, str(o.artifact))
    if state.is_failed() or state.is_crashed():
        exc = state.result(raise_on_failure=False)
        return StageReport(plan.name, plan.kind, "failed", getattr(exc, "seconds", 0.0), {}, None,
                           None, error=str(exc) if isinstance(exc, BaseException) else state.message)
    return StageReport(plan.name, plan.kind, "skipped", 0.0, {}, None, None,
                       error="an upstream stage failed")


# The ranks of every node together (`--nproc` x `--nnodes`): an rl stage's result depends on their number, so a
# reproduction reruns on that many processes (one machine's worth lands on the same digest).
NPROC_TAG = "alignflow.nproc"


def start_tracking(session: Session) -> str:
    """Open the MLflow parent run with the spec and data.dvc as artifacts; returns its id."""
    tags = {"prefect.flow_run_id": str(flow_run.get_id()), "alignflow.pipeline": session.spec.name,
            "alignflow.data_version": str(data_version(session.project)),
            NPROC_TAG: str(session.options.total_processes), **git_state(session.project)}
    files = {"spec.yaml": session.spec_text}
    dvc_file = session.project / "data.dvc"
    if dvc_file.is_file():
        files["data.dvc"] = dvc_file.read_text()
    return session.tracker.start_pipeline(session.spec.name, {"seed": session.spec.seed}, tags, files)


@flow(name="alignflow-pipeline", flow_run_name="{pipeline}", persist_result=False)
def pipeline_flow(pipeline: str, overrides: list[str] | None = None, project: str = ".",
                  artifacts: str | None = None, options: dict | None = None,
                  checked: CheckedSpec | None = None, guard: shutdown.RunGuard | None = None) -> PipelineReport:
    """Run every stage of a pipeline spec; cached stages are reused, failures stop descendants. `options`:
    `RunOptions.as_dict()`, else (a deployment's run) from the environment; `checked`, `guard`: else made here."""
    guard = guard or shutdown.RunGuard()
    guard.running_flow(str(flow_run.get_id()))  # a SIGTERM sets it Crashed
    run_options = RunOptions.from_env() if options is None else RunOptions.from_dict(options)
    session = open_session(Path(pipeline), list(overrides or []), Path(project).resolve(),
                           artifacts if is_url(artifacts) else Path(artifacts).resolve() if artifacts else None,
                           run_options, checked, guard)
    mlflow_run_id = start_tracking(session)
    futures = submit_stages(session)
    wait(list(futures.values()))
    stages = [stage_report(session.plans[n], futures[n].state) for n in session.spec.order()]
    report = PipelineReport(str(flow_run.get_id()), mlflow_run_id, session.spec.name, stages,
                            session.tracker.uri, time.perf_counter() - session.started)
    register_final_model(session, report)
    session.tracker.end_pipeline(report.failed, report.final_metrics())
    if report.failed:
        return Failed(message=f"stages failed: {', '.join(s.name for s in report.failed)}", data=report)
    return report


def register_final_model(session: Session, report: PipelineReport) -> None:
    """Register the last stage with a model output, when it produced a new artifact this run."""
    if report.failed:
        return
    for line in reversed(report.stages):
        outcome_path = Path(line.artifact) if line.artifact else None
        if outcome_path is None:
            continue
        manifest = session.store.manifest(line.name, outcome_path.name) or {}
        if "model" not in manifest.get("outputs", {}):
            continue
        if line.status in ("ran", "resumed"):
            model = session.store.published(manifest, line.name)["model"]  # a URL on a shared store
            line.model_version = session.tracker.register_model(session.spec.name, model,
                                                                manifest["mlflow_run_id"])
        return


def run_pipeline(pipeline: Path, overrides: list[str] = (), project: Path = Path("."),
                 artifacts: Path | str | None = None, options: RunOptions | None = None,
                 checked: CheckedSpec | None = None, guard: shutdown.RunGuard | None = None) -> PipelineReport:
    """Run `pipeline_flow` on the checked spec (None: check it first, before anything starts) with `options`
    (None: `RunOptions.from_env()`) and return its report, also when stages failed."""
    checked = checked or check_pipeline(pipeline, list(overrides), project, regenerate=True)
    options = RunOptions.from_env() if options is None else options
    start_temporary_server()  # one at a time per database, before the flow would start one unguarded
    state = pipeline_flow(str(pipeline), list(overrides), str(project),
                          str(artifacts) if artifacts else None, options.as_dict(), checked, guard, return_state=True)
    result = state.result(raise_on_failure=False)
    if isinstance(result, BaseException):
        raise result
    return result
