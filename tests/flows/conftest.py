import json
import uuid
from pathlib import Path

import pytest
from prefect.settings import PREFECT_SERVER_ANALYTICS_ENABLED, temporary_settings
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session")
def prefect_server():
    """One real ephemeral Prefect server (temporary database), started by the first test that needs it."""
    # Without analytics, as `alignflow run` starts its server: the telemetry heartbeat it runs at startup reads
    # then writes the configuration table in a deferred transaction, which SQLite cannot upgrade to a write
    # once another connection has committed; under load it failed at once with "database is locked" (the
    # busy timeout does not apply), in the first test's setup.
    with temporary_settings({PREFECT_SERVER_ANALYTICS_ENABLED: False}):
        with prefect_test_harness(server_startup_timeout=180):
            yield


@pytest.fixture(autouse=True)
def prefect_for_system_tests(request):
    """The flows' `system` tests run pipelines, deployments and children against the server; no other test starts
    it, nor do vLLM's (they run stages directly, in an environment of their own). A module fixture that runs a
    pipeline asks for `prefect_server` itself: pytest sets it up before this one, and without the server it
    would run on a temporary server of its own, whose records the test then cannot read."""
    if request.node.get_closest_marker("system") and not request.node.get_closest_marker("vllm"):
        request.getfixturevalue("prefect_server")


PROMPTS = ["1+1", "2+2", "1+1", "3+3", "4+4", "2+2", "5+5", "6+6", "7+7", "8+8"]

# a -> b -> c, and d, a sibling of b reading from a.
PIPELINE = """
name: chain
seed: 3
stages:
  a:
    kind: select
    inputs: {dataset: in.jsonl}
    selectors: [dedup]
  b:
    kind: select
    inputs: {dataset: "stage:a"}
    selectors: [{name: subsample, config: {n: 5}}]
  c:
    kind: select
    inputs: {dataset: "stage:b"}
    selectors: [{name: column_filter, config: {column: level, in: [1, 2]}}]
  d:
    kind: select
    inputs: {dataset: "stage:a"}
    selectors: [{name: column_filter, config: {column: level, equals: 3}}]
"""


def write_project(root: Path) -> Path:
    """A project folder with a small JSONL input and the chain pipeline."""
    root.mkdir(parents=True, exist_ok=True)
    rows = [{"prompt": p, "level": i % 3 + 1} for i, p in enumerate(PROMPTS)]
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "chain.yaml").write_text(PIPELINE)
    return root


@pytest.fixture(scope="session")
def make_project():
    return write_project


@pytest.fixture(params=["memory", "file"])
def url(request, tmp_path) -> str:
    """A fresh store: `memory://` (one process) or a `file://` URL (a shared filesystem, other processes)."""
    if request.param == "memory":
        return f"memory://alignflow-test/{uuid.uuid4().hex[:8]}"
    return (tmp_path / "shared").as_uri()
