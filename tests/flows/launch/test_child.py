"""Stages in a child process: results, metrics and errors come back; plugins are rebuilt or refused."""

import multiprocessing
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core import hookimpl
from alignflow.core.train.checkpoint import CheckpointError
from alignflow.core.errors import SpecError
from alignflow.core.plugins import Plugins, get_plugins
from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.launch.child import ChildFailed, plugin_recipe, run_in_child
from alignflow.flows.launch.execute import data_parallel_ranks
from alignflow.flows.options import NPROC_ENV, PARALLEL_ENV, RunOptions
from alignflow.flows.launch.ranks import run_in_processes
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.sft import run_sft

pytestmark = pytest.mark.usefixtures("one_thread")


class Importable:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("importable_reward", lambda prompts, completions, **_: [0.0] * len(prompts))


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("child-data")
    rows = write_datasets(root)["sft"].read_text().splitlines()[:64]
    (root / "small.jsonl").write_text("\n".join(rows) + "\n")
    return root / "small.jsonl"


def context(tmp_path, data, model="builtin:tiny", **settings):
    spec = parse_spec({"name": "s", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": model, "dataset": str(data)}, "algorithm": "sft",
        "settings": {"lr": 1e-3, "max_length": 64, "batch_size": 8, "micro_batch_size": 8, "log_every": 2,
                     "save_every": 100, **settings}}}})
    stage, logged = spec.stages["sft"], []
    ctx = StageContext("sft", stage, TrainSettings.model_validate(stage.settings), dict(stage.inputs),
                       tmp_path / "work", tmp_path / "checkpoints", 0, lambda m, s: logged.append((s, m)),
                       get_plugins())
    ctx.work_dir.mkdir(parents=True)
    return ctx, logged


@pytest.mark.system
def test_a_child_gives_the_result_and_metrics_of_a_run_here(tmp_path, data):
    here_ctx, here_logged = context(tmp_path / "here", data, max_steps=4)
    here = run_sft(here_ctx)
    child_ctx, child_logged = context(tmp_path / "child", data, max_steps=4)
    child = run_in_child("sft", child_ctx, threads=1)
    assert child.metrics == here.metrics and child.headline == here.headline
    assert child_logged == here_logged and {2, 4} <= {s for s, _ in child_logged}
    a, b = (load_file(r.outputs["model"] / "model.safetensors") for r in (here, child))
    assert all(torch.equal(a[k], b[k]) for k in a)


# 8 rows a step: in one process two micro-batches of 4 accumulated, on two ranks 4 rows on each; the 16
# held-out rows are four micro-batches, two on each rank
TWO_RANKS = {"max_steps": 4, "micro_batch_size": 4, "eval_fraction": 0.25}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, data):
    """One run of the stage on two ranks, for the tests below: (its folder, logged metrics, result)."""
    root = tmp_path_factory.mktemp("two-ranks")
    ctx, logged = context(root, data, **TWO_RANKS)
    return root, logged, run_in_processes("sft", ctx, threads=1, ranks=2)


@pytest.mark.system
def test_two_ranks_train_as_one_process_does_on_the_same_global_batch(tmp_path, data, two_ranks):
    here_ctx, here_logged = context(tmp_path / "here", data, **TWO_RANKS)
    here = run_sft(here_ctx)
    ranks_root, ranks_logged, ranks = two_ranks
    # rank 0 logs once for the stage, and its loss and accuracy are over both ranks' rows (its own
    # share of the loss alone would be about half)
    assert [s for s, _ in ranks_logged] == [s for s, _ in here_logged]
    for (_, a), (_, b) in zip(here_logged, ranks_logged):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), key
    assert "eval/loss" in ranks_logged[-1][1]  # the held-out rows were scored (and agree, above)
    a, b = (load_file(r.outputs["model"] / "model.safetensors") for r in (here, ranks))
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
    # two processes did train: the last checkpoint holds a random state per rank
    states = {run: sorted(p.name for p in root.rglob("rng-rank*.pt")) for run, root in
              (("here", tmp_path / "here"), ("ranks", ranks_root))}
    assert states == {"here": ["rng-rank0.pt"], "ranks": ["rng-rank0.pt", "rng-rank1.pt"]}


@pytest.mark.system
def test_a_stage_two_ranks_checkpointed_resumes_on_two_ranks_only(tmp_path, data, two_ranks):
    ranks_root = two_ranks[0]  # its last checkpoint (step 4) was saved by two processes
    ctx, _ = context(tmp_path / "one", data, **{**TWO_RANKS, "max_steps": 6})
    ctx.checkpoint_dir = ranks_root / "checkpoints"
    with pytest.raises(CheckpointError, match=r"saved by 2 processes and this run has 1: resume it on 2 "
                                              r"\(alignflow run --nproc 2\)"):
        run_sft(ctx)


@pytest.mark.system
def test_a_child_raises_what_the_runner_raised(tmp_path, data):
    ctx, _ = context(tmp_path, data, model="builtin:nope", max_steps=2)
    with pytest.raises(SpecError, match="unknown built-in model 'nope'") as info:
        run_in_child("sft", ctx, threads=1)
    assert any("in the stage's process" in note for note in info.value.__notes__)


@pytest.mark.system
def test_a_killed_child_is_a_clear_failure(tmp_path, data):
    ctx, _ = context(tmp_path, data, max_steps=100_000)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("error", _raises(run_in_child, "sft", ctx, 1)))
    thread.start()
    deadline = time.monotonic() + 120
    while not (children := [c for c in multiprocessing.active_children() if c.name == "alignflow-sft"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(1.0)
    children[0].kill()
    thread.join(60)
    assert isinstance(outcome["error"], ChildFailed)
    assert "exited with code -9 without a result" in str(outcome["error"])


ORPHAN = """
import os, sys, threading, time
from pathlib import Path
sys.path.insert(0, {tests!r})
import test_child
from alignflow.flows.launch.child import run_in_child
import multiprocessing
ctx, _ = test_child.context(Path({root!r}), Path({data!r}), max_steps=100_000)
threading.Thread(target=run_in_child, args=("sft", ctx, 1), daemon=True).start()
while not multiprocessing.active_children():
    time.sleep(0.05)
print(multiprocessing.active_children()[0].pid, flush=True)
time.sleep(1.0)
os._exit(0)  # the pipeline process dies without cleaning up
"""


@pytest.mark.system
def test_a_child_stops_when_the_pipeline_process_dies(tmp_path, data):
    script = ORPHAN.format(tests=str(Path(__file__).parent), root=str(tmp_path), data=str(data))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid):
        assert time.monotonic() < deadline, f"child {pid} outlived its parent"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0  # a zombie is gone


def test_parallel_stages_come_from_the_flag_else_the_environment():
    assert RunOptions.from_env({PARALLEL_ENV: "3"}).parallel_stages == 3
    assert RunOptions.from_env({PARALLEL_ENV: "3"}, parallel=2).parallel_stages == 2  # the flag wins
    with pytest.raises(SpecError, match="ALIGNFLOW_PARALLEL_STAGES='0': expected a whole number"):
        RunOptions.from_env({PARALLEL_ENV: "0"})
    assert RunOptions.from_env({}).parallel_stages == max(1, (os.cpu_count() or 1) // 8)


def _raises(fn, *args):
    try:
        fn(*args)
    except Exception as exc:
        return exc
    return None


def test_plugin_recipe_rebuilds_importable_plugins_and_refuses_local_ones():
    plugins = get_plugins()
    assert plugin_recipe(plugins) == []  # the entry points: a child loads them itself
    plugins.add(Importable, "importable")
    try:
        assert plugin_recipe(plugins) == [(f"{__name__}:Importable", "importable", "__main__", "0")]
    finally:
        plugins.remove("importable")

    class Local:
        @staticmethod
        @hookimpl
        def register_rewards(register):
            register("local_reward", lambda prompts, completions, **_: [0.0] * len(prompts))

    own = Plugins()
    own.add(Local, "local")
    assert plugin_recipe(own) is None


def test_nproc_applies_to_the_data_parallel_stage_kinds_only():
    options = RunOptions.from_env({NPROC_ENV: "2"})
    kinds = ("sft", "reward_model", "prm", "preference", "rl", "rejection_sampling", "step_labels", "evaluate")
    assert [data_parallel_ranks(k, options) for k in kinds] == [2] * len(kinds)
    assert data_parallel_ranks("select", options) == 1
    with pytest.raises(SpecError, match="ALIGNFLOW_NPROC='0': expected a whole number of processes"):
        RunOptions.from_env({NPROC_ENV: "0"})  # a bad value is an error whatever the stages
    with pytest.raises(SpecError, match="ALIGNFLOW_NPROC='two': expected a whole number of processes"):
        RunOptions.from_env({NPROC_ENV: "two"})
    assert data_parallel_ranks("sft", RunOptions.from_env({})) == 1


def test_a_free_stage_slot_goes_to_the_waiting_stage_first_in_the_pipeline_order():
    """Siblings made ready at once (an evaluation and a long RL stage after the cold start) queue
    before the slot is taken; the one first in the dependency order runs first."""
    import threading

    from alignflow.flows.launch.execute import OrderedSlots

    slots, started, gate = OrderedSlots(1), [], threading.Event()

    def stage(order: int, name: str) -> None:
        with slots.held((order, name)):
            started.append(name)
            gate.wait(5)

    grpo = threading.Thread(target=stage, args=(2, "grpo"))
    grpo.start()  # the RL stage asks first ...
    time.sleep(0.05)
    evaluation = threading.Thread(target=stage, args=(1, "eval_sft"))
    evaluation.start()  # ... the evaluation, first in the order, a moment later
    time.sleep(OrderedSlots.SETTLE_S + 0.5)
    gate.set()
    grpo.join(10)
    evaluation.join(10)
    assert started == ["eval_sft", "grpo"]
