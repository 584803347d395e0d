"""`alignflow deploy`: a scheduled Prefect deployment of the pipeline flow on a process work pool."""

from __future__ import annotations

from pathlib import Path


def ensure_process_pool(name: str) -> None:
    """Create the work pool as a `process` pool (no Docker) unless it exists."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
        except ObjectAlreadyExists:
            pass


def deploy(pipeline: Path, cron: str, pool: str, project: Path, name: str | None = None) -> str:
    """Deploy `pipeline_flow` for this spec on a cron schedule; returns the deployment's name."""
    from prefect.deployments.runner import EntrypointType

    from alignflow.flows.pipeline import load_pipeline, pipeline_flow

    spec = load_pipeline(pipeline, [])
    ensure_process_pool(pool)
    name = name or spec.name
    # A module entrypoint: the worker imports the installed alignflow, so no code storage is needed.
    pipeline_flow.deploy(
        name, work_pool_name=pool, cron=cron, build=False, push=False, print_next_steps=False,
        entrypoint_type=EntrypointType.MODULE_PATH,
        parameters={"pipeline": str(pipeline.resolve()), "project": str(project.resolve())},
        job_variables={"working_dir": str(project.resolve())},
    )
    return f"{pipeline_flow.name}/{name}"
