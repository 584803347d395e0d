"""A stage's ranks on two "nodes" over 127.0.0.1: two `alignflow run` processes of one rank each train
as one run of `--nproc 2` does, and a rank killed on one node stops the other with the rank named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.train.engine import free_port
from alignflow.core.errors import SpecError
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows import cli_run
from alignflow.flows.cli import build_parser
from alignflow.flows.cli_run import cmd_run
from alignflow.flows.launch.nodes import LAUNCHER_VARS
from alignflow.flows.options import (NNODES_ENV, NODE_RANK_ENV, NPROC_ENV, RDZV_ENDPOINT_ENV, Nodes, RunOptions,
                                     parse_nodes)
from alignflow.flows.pipeline import run_pipeline
from alignflow.flows.launch.shutdown import descendants

pytestmark = pytest.mark.system

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


@pytest.fixture(scope="module")
def reference(project) -> Path:
    """The sft stage run here with --nproc 2 (one node of two ranks) into its own artifacts folder."""
    report = run_pipeline(project / "one.yaml", [], project, project / "one-node", RunOptions(nproc=2))
    return Path(next(s for s in report.stages if s.name == "sft").artifact)


def test_two_nodes_of_one_rank_train_as_one_run_of_two_ranks(project, two_nodes, reference):
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
    # the console wraps long lines where the terminal width falls: compare with whitespace collapsed
    assert ("stage 'sft_long': the stage's rank 1 process on node 1 exited with code -9 (SIGKILL)"
            in " ".join(output.split()))
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


def test_deepspeeds_launcher_starts_a_run_of_its_processes(project, reference):
    """`deepspeed --num_gpus 2 alignflow run ...`: local rank 0 runs the pipeline with --nproc 2, local rank 1
    exits; the stage trains on two ranks (the run's alignflow.nproc tag) to the --nproc 2 run's weights."""
    script = Path(sys.executable).parent / "alignflow"
    command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "2", "--master_port",
               str(free_port()), str(script), "run", "one.yaml", "--json", "--artifacts", str(project / "deepspeed")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for var in ("MLFLOW_TRACKING_URI", "PREFECT_API_URL", NPROC_ENV, NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV):
        env.pop(var, None)
    done = subprocess.run(command, cwd=project, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "DeepSpeed launcher: local rank 1 exits" in " ".join(output.split())
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith('{"run_id"')))
    from mlflow.tracking import MlflowClient

    tags = MlflowClient(f"sqlite:///{project / 'mlflow.db'}").get_run(result["mlflow_run_id"]).data.tags
    assert tags["alignflow.nproc"] == "2"
    artifact = project / "deepspeed" / "sft" / reference.name  # the same digest
    a, b = (load_file(p / "out" / "model" / "model.safetensors") for p in (reference, artifact))
    assert all(torch.allclose(a[k], b[k], atol=1e-6, rtol=0) for k in a)


def test_deepspeeds_launcher_variables_map_onto_nodes(monkeypatch):
    """Host 1 of 2, four processes each, as `deepspeed --hostfile` starts them on the second host."""
    env = {"CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "4", "LOCAL_RANK": "0", "MASTER_ADDR": "10.0.0.1",
           "MASTER_PORT": "29500", "RANK": "4", "WORLD_SIZE": "8"}
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    args = build_parser().parse_args(["--local_rank=0", "run", "x.yaml"])
    assert cli_run._from_deepspeed_launcher(args)
    assert (args.nproc, args.nnodes, args.node_rank, args.rdzv_endpoint) == (4, "2", "1", "10.0.0.1:29500")
    assert not any(var in os.environ for var in LAUNCHER_VARS)  # the stages' ranks get theirs from torch
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert not cli_run._from_deepspeed_launcher(build_parser().parse_args(["run", "x.yaml"]))  # it exits
    monkeypatch.setenv("LOCAL_RANK", "0")
    with pytest.raises(SpecError, match="--nproc: started by DeepSpeed's launcher"):
        cli_run._from_deepspeed_launcher(build_parser().parse_args(["run", "x.yaml", "--nproc", "2"]))
