import json
import uuid
from pathlib import Path

import pytest
import torch
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(scope="session", autouse=True)
def prefect_server():
    """One real ephemeral Prefect server (temporary database) for every flow test."""
    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on a busy 2-core box OpenMP's spinning threads make each step 4x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def local_mlflow(monkeypatch):
    """MLflow goes to the project's SQLite file, never to a server set in the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


@pytest.fixture
def sgd_two_micro_batches() -> dict:
    """Stage settings: plain SGD over two micro-batches a step, so the weights move by exactly lr x the
    gradient and two ways of computing the same step (ZeRO stages) must land on the same weights."""
    return {"lr": 0.5, "optimizer": "sgd", "grad_clip": 0.0, "max_steps": 2, "batch_size": 8,
            "micro_batch_size": 4, "lr_scheduler": "constant"}

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
