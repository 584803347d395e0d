"""Run options (flows/options.py): flags over variables, read once, and carried to a stage's ranks
without a write to the environment."""

from __future__ import annotations

import os

import pytest
import yaml

from alignflow.core.errors import SpecError
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows import cli
from alignflow.flows.options import AUTO_PRECISION_ENV, LEASE_ENV, LOCK_ENV, NPROC_ENV, Nodes, RunOptions


def test_flags_override_the_variables_and_errors_name_what_was_given():
    env = {NPROC_ENV: "3", "ALIGNFLOW_NNODES": "2", "ALIGNFLOW_RDZV_ENDPOINT": "10.0.0.1:29400",
           "ALIGNFLOW_CACHE": "/c", LEASE_ENV: "30", LOCK_ENV: "none"}
    options = RunOptions.from_env(env, nproc=2, node_rank="1")
    assert options == RunOptions(nproc=2, nodes=Nodes(2, 1, "10.0.0.1", 29400), cache="/c", artifact_lock="none",
                                 lock_lease_s=30.0)
    assert options.total_processes == 4
    assert RunOptions.from_dict(options.as_dict()) == options  # a child's payload, a flow run's parameters
    with pytest.raises(SpecError, match="--node-rank=2: must be below ALIGNFLOW_NNODES=2"):
        RunOptions.from_env(env, node_rank="2")
    with pytest.raises(SpecError, match="ALIGNFLOW_LOCK_LEASE_S='-1': expected a number of seconds above 0"):
        RunOptions.from_env({LEASE_ENV: "-1"})
    with pytest.raises(SpecError, match="ALIGNFLOW_ARTIFACT_LOCK='off': expected 'lease' or 'none'"):
        RunOptions.from_env({LOCK_ENV: "off"})


def test_auto_precision_is_read_once_and_travels_in_a_childs_payload():
    options = RunOptions.from_env({AUTO_PRECISION_ENV: "bf16-mixed"})
    assert options.auto_precision == "bf16-mixed" and RunOptions.from_env({}).auto_precision is None
    assert RunOptions.from_dict(options.as_dict()).auto_precision == "bf16-mixed"  # what a stage's ranks get
    with pytest.raises(SpecError, match="ALIGNFLOW_AUTO_PRECISION='bf16': expected fp32 or bf16-mixed"):
        RunOptions.from_env({AUTO_PRECISION_ENV: "bf16"})


@pytest.mark.system  # starts two ranks
def test_nproc_given_as_a_flag_reaches_the_stages_ranks_and_the_environment_is_untouched(tmp_path, monkeypatch,
                                                                                         capsys):
    """`run --nproc 2` over ALIGNFLOW_NPROC=1: the sft stage's two ranks form a group of two (its 8 rows a
    step do not split into micro-batches of 8 on each, which the engine refuses naming the world size)."""
    write_datasets(tmp_path / "data")
    (tmp_path / "p.yaml").write_text(yaml.safe_dump({"name": "ranks", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": "data/sft.jsonl"}, "algorithm": "sft",
        "settings": {"max_steps": 1, "batch_size": 8, "micro_batch_size": 8, "max_length": 96}}}}))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(NPROC_ENV, "1")
    monkeypatch.setattr(cli, "configure_logging", lambda: None)  # its handler would keep capsys's stream
    before, names = {k: v for k, v in os.environ.items() if k.startswith("ALIGNFLOW_")}, set(os.environ)
    try:
        code = cli.main(["run", "p.yaml", "--nproc", "2", "--json"])
    finally:
        for var in set(os.environ) - names:  # the third-party defaults `main` sets (Prefect's, OpenMP's)
            del os.environ[var]
    out = capsys.readouterr()
    assert code == 1
    assert "world size 2" in " ".join(out.err.split())
    assert {k: v for k, v in os.environ.items() if k.startswith("ALIGNFLOW_")} == before
