"""`alignflow deploy`: a scheduled Prefect deployment of the pipeline flow on a process work pool, and
of the stage flow on each work pool its stages name."""

from __future__ import annotations

from pathlib import Path

from alignflow.flows.pipeline import pipeline_flow
from alignflow.flows.preflight import check_pipeline
from alignflow.flows.launch.pools import deploy_stage_flow, ensure_process_pool


def stage_pools(spec) -> list[str]:
    """The work pools the spec's stages name (`pool`, or `pools` by kind), sorted."""
    return sorted({pool for name in spec.stages if (pool := spec.pool_of(name)) is not None})


def deploy(pipeline: Path, cron: str, pool: str, project: Path, name: str | None = None) -> tuple[str, list[str]]:
    """Deploy `pipeline_flow` for this spec on a cron schedule, and `stage_flow` on each pool its stages
    name (flows/launch/pools.py), so their workers can start before the first run; returns the deployment's
    name and those pools. Its runs take their options from the worker's environment (`pipeline_flow`)."""
    from prefect.deployments.runner import EntrypointType

    spec = check_pipeline(pipeline, [], project, regenerate=True).spec
    ensure_process_pool(pool)
    name = name or spec.name
    # A module entrypoint: the worker imports the installed alignflow, so no code storage is needed.
    pipeline_flow.deploy(
        name, work_pool_name=pool, cron=cron, build=False, push=False, print_next_steps=False,
        entrypoint_type=EntrypointType.MODULE_PATH,
        parameters={"pipeline": str(pipeline.resolve()), "project": str(project.resolve())},
        job_variables={"working_dir": str(project.resolve())},
    )
    pools = stage_pools(spec)
    for stage_pool in pools:
        deploy_stage_flow(stage_pool)
    return f"{pipeline_flow.name}/{name}", pools
