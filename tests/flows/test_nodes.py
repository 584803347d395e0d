"""A stage's ranks on two "nodes" over 127.0.0.1: two `alignflow run` processes of one rank each train
as one run of `--nproc 2` does, and a rank killed on one node stops the other with the rank named."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.engine import free_port
from alignflow.core.errors import SpecError
from alignflow.core.task import write_datasets
from alignflow.flows.cli import build_parser, cmd_run
from alignflow.flows.execute import NPROC_ENV
from alignflow.flows.nodes import NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV, Nodes, parse_nodes
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.shutdown import descendants

# sft trains 4 steps of 8 rows, 4 a rank; sft_long, after it, trains until a test kills a rank.
SFT = """
  sft:
    kind: sft
    inputs: {model: "builtin:tiny", dataset: small.jsonl}
    algorithm: sft
    settings: {lr: 1.0e-3, max_steps: 4, batch_size: 8, micro_batch_size: 4, max_length: 64, log_every: 2,
               save_every: 100}
"""
LONG = """
  sft_long:
    kind: sft
    inputs: {model: "stage:sft", dataset: small.jsonl}
    algorithm: sft
    settings: {lr: 1.0e-3, max_steps: 100000, batch_size: 8, micro_batch_size: 4, max_length: 64,
               save_every: 2}
"""
HEAD = "name: nodes\nseed: 0\nstages:"


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nodes")
    rows = write_datasets(root / "generated")["sft"].read_text().splitlines()[:64]
    (root / "small.jsonl").write_text("\n".join(rows) + "\n")
    (root / "one.yaml").write_text(HEAD + SFT)
    (root / "two.yaml").write_text(HEAD + SFT + LONG)
    return root


def _node(project: Path, rank: int, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "alignflow.flows.cli", "run", "two.yaml", "--parallel", "1", "--nnodes", "2",
               "--node-rank", str(rank), "--rdzv-endpoint", f"127.0.0.1:{port}", "--artifacts", str(project / "shared")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", NPROC_ENV, NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV):
        env.pop(var, None)  # node 0 starts its own temporary Prefect server and MLflow file, as a user's run does
    log = (project / f"node{rank}.log").open("w")  # a file, not a pipe that fills while nobody reads it
    return subprocess.Popen(command, cwd=project, env=env, stdout=log, stderr=subprocess.STDOUT)


def _rank_processes(pid: int) -> list[int]:
    """The rank processes the elastic launcher spawned under `pid` (not multiprocessing's resource tracker)."""
    found = []
    for p in descendants(pid):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(p)
    return found


@pytest.fixture(scope="module")
def two_nodes(project):
    """Both nodes run two.yaml: sft to its end, then sft_long until node 1's rank is killed mid-training."""
    port = free_port()
    nodes = [_node(project, 1, port), _node(project, 0, port)]  # node 1 first: it waits for node 0
    try:
        deadline = time.monotonic() + 900
        while not list((project / "shared").glob("sft_long/*/checkpoints/**/rng-rank1.pt")):
            assert time.monotonic() < deadline and all(n.poll() is None for n in nodes), "sft_long never checkpointed"
            time.sleep(0.5)
        ranks = _rank_processes(nodes[0].pid)
        assert len(ranks) == 1, ranks  # node 1 has one rank, in sft_long now
        os.kill(ranks[0], signal.SIGKILL)
        for n in nodes:
            n.wait(timeout=300)
    finally:
        for n in nodes:
            n.kill()
    return {f"node{rank}": (n.returncode, (project / f"node{rank}.log").read_text()) for rank, n in zip((1, 0), nodes)}


def test_two_nodes_of_one_rank_train_as_one_run_of_two_ranks(project, two_nodes, monkeypatch):
    # the same stage run here with --nproc 2 (one node of two ranks) into another artifacts folder
    monkeypatch.setenv(NPROC_ENV, "2")
    report = run_pipeline(project / "one.yaml", [], project, project / "one-node")
    reference = Path(next(s for s in report.stages if s.name == "sft").artifact)
    shared = list((project / "shared" / "sft").iterdir())
    shared = [p for p in shared if (p / "manifest.json").is_file()]
    assert [p.name for p in shared] == [reference.name]  # one digest, however the ranks are split over nodes
    a, b = (load_file(p / "out" / "model" / "model.safetensors") for p in (reference, shared[0]))
    assert a.keys() == b.keys()
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)
    assert "node 1: stage 'sft' done with node 0" in two_nodes["node1"][1]


def test_a_rank_killed_on_one_node_stops_the_other_with_the_rank_named(two_nodes):
    code, output = two_nodes["node1"]
    assert code == 1
    assert "stage 'sft_long': the stage's rank 1 process on node 1 exited with code -9 (SIGKILL)" in output
    code, output = two_nodes["node0"]
    assert code == 1  # its rank 0 was stopped; the summary shows the stage failed, naming rank 1
    assert "rank 1 on node 1 failed: exited with code -9 (SIGKILL)" in " ".join(output.split())
    assert "this node's ranks were stopped" in " ".join(output.split())


@pytest.mark.parametrize("flags,message", [
    (["--nnodes", "2", "--node-rank", "2", "--rdzv-endpoint", "h:29400"],
     "--node-rank=2: must be below --nnodes=2 (node ranks are 0 to 1)"),
    (["--nnodes", "2"], "--nnodes=2 needs --rdzv-endpoint=HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1"], "--rdzv-endpoint='10.0.0.1': expected HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "10.0.0.1:99999"], "--rdzv-endpoint='10.0.0.1:99999': expected HOST:PORT"),
    (["--nnodes", "two", "--rdzv-endpoint", "h:1"], "--nnodes='two': expected a whole number, at least 1"),
])
def test_bad_node_flags_are_spec_errors_naming_the_flag(flags, message, monkeypatch):
    for var in (NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV):
        monkeypatch.delenv(var, raising=False)
    args = build_parser().parse_args(["run", "missing.yaml", *flags])
    with pytest.raises(SpecError) as info:
        cmd_run(args)  # before the spec is read
    assert message in str(info.value)


def test_nodes_from_the_environment():
    assert parse_nodes("2", "1", "[::1]:29400") == Nodes(2, 1, "::1", 29400)
    assert parse_nodes(None, None, None) == Nodes()
    with pytest.raises(SpecError, match=r"ALIGNFLOW_NODE_RANK=1: must be below ALIGNFLOW_NNODES=1"):
        parse_nodes("1", "1", None)
