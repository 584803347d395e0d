"""A stopped pipeline finds its stages' flow runs on work pools by their tag, sent or still being sent."""

from __future__ import annotations

import uuid

import pytest
from prefect import get_client
from prefect.deployments import run_deployment
from prefect.states import Completed

from alignflow.flows.launch import shutdown
from alignflow.flows.launch.pools import deploy_stage_flow

pytestmark = pytest.mark.system


def send(deployment: str, stage: str, pipeline_run: str):
    """A stage's flow run as run_on_pool creates it (no worker on the pool: it stays Scheduled)."""
    return run_deployment(deployment, timeout=0, as_subflow=False, flow_run_name=f"p.{stage}",
                          parameters={"spec": "", "source": "p.yaml", "stage": stage, "digest": "d",
                                      "project": "/nowhere", "artifacts": "/nowhere"},
                          tags=[shutdown.pipeline_run_tag(pipeline_run)])


def test_a_stop_cancels_every_unfinished_flow_run_of_its_pipeline_run_and_no_other():
    deployment = deploy_stage_flow("idle")
    mine, other = str(uuid.uuid4()), str(uuid.uuid4())
    scheduled = send(deployment, "sft", mine)  # never recorded anywhere in this process: found by its tag
    done = send(deployment, "data", mine)
    elsewhere = send(deployment, "sft", other)  # another pipeline run's
    with get_client(sync_client=True) as client:
        client.set_flow_run_state(done.id, Completed(), force=True)
    asked = shutdown.cancel_pool_runs(mine, "stopped by SIGINT")
    assert asked == {str(scheduled.id): f"stage 'sft' on work pool 'idle': flow run p.sft ({scheduled.id})"}
    assert shutdown.await_cancelled(asked, wait_s=30) == {str(scheduled.id): "Cancelled"}
    with get_client(sync_client=True) as client:
        states = {r: client.read_flow_run(r).state for r in (scheduled.id, done.id, elsewhere.id)}
    assert [s.name for s in states.values()] == ["Cancelled", "Completed", "Scheduled"]
    # the second look, after the first ones were waited for, asks none twice
    late = send(deployment, "rl", mine)
    assert list(shutdown.cancel_pool_runs(mine, "stopped", skip=frozenset(asked))) == [str(late.id)]


def test_no_stage_is_sent_once_a_stop_began():
    guard = shutdown.RunGuard()
    guard.sending_to_pool()
    guard.stopping = True
    with pytest.raises(RuntimeError, match="the pipeline is stopping"):
        guard.sending_to_pool()
