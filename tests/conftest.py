"""Test tiers and the fixtures every folder shares.

Tiers (pyproject registers them): `unit` (no server, no subprocess, seconds), `stage` (stages or the tiny model,
in-process), `system` (Prefect servers, subprocesses, signals, nodes, work pools, ranks). A test's tier is its
explicit marker (a decorator or a module's `pytestmark`), else `system` when it uses a fixture that starts a server,
else `stage` when it uses the tiny model, else `unit`. Outside `system`, starting a process (other than a library's
probe of the machine) fails the test, so a test cannot drift out of that tier unnoticed. `pytest -m "not system"`
is the inner loop; CI runs all, in two pytest-xdist workers (helpers/workers.py: which tests share a worker).
"""

import os

# before any test imports torch: OpenMP threads sleep while they wait (as `alignflow` sets for its runs), so
# the suite's two-thread processes do not spin against each other on a loaded machine
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# `precision: auto` resolves to fp32 on every machine (see `auto_precision_is_fp32`), in module- and session-scoped
# fixtures' processes too, which start before any function-scoped fixture runs
AUTO_PRECISION_ENV = "ALIGNFLOW_AUTO_PRECISION"  # alignflow.flows.options.AUTO_PRECISION_ENV
os.environ[AUTO_PRECISION_ENV] = "fp32"
# and `async_rollouts: auto` stays off (see `auto_overlap_is_off`)
AUTO_OVERLAP_ENV = "ALIGNFLOW_AUTO_OVERLAP"  # alignflow.flows.options.AUTO_ASYNC_ENV
os.environ[AUTO_OVERLAP_ENV] = "false"

import multiprocessing.process  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
from helpers.tiers import default_tier, tiers_of  # noqa: E402
from helpers.workers import group_by_module, name_groups  # noqa: E402


@pytest.hookimpl(wrapper=True)  # around pytest-xdist's own, which reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        group_by_module(item)  # under `-n N --dist loadgroup`: a module's shared fixtures are built once
        if not tiers_of(item):
            item.add_marker(default_tier(item))
    yield
    if getattr(config.option, "loadgroup", False):  # a worker of `--dist loadgroup`
        name_groups(items)


def pytest_ignore_collect(collection_path, config):
    """Under `-m vllm` (the vLLM environment's run) only the modules that hold vLLM tests are imported: each says
    `pytest.mark.vllm` (tests/test_ci.py checks that the modules needing vLLM do); importing the whole suite to
    select their 16 tests took a minute on a loaded 2-core machine."""
    name = collection_path.name
    if config.option.markexpr == "vllm" and name.startswith("test_") and name.endswith(".py"):
        return "pytest.mark.vllm" not in collection_path.read_text()
    return None


# what libraries run to inspect the machine (DeepSpeed asks numactl for the NUMA layout, MLflow asks git for the
# commit): quick, no server, no Python; any other process is the `system` tier's
PROBES = {"numactl", "git", "lscpu", "nvidia-smi", "ldconfig", "uname"}


@pytest.fixture(autouse=True)
def processes_only_in_system_tests(request, monkeypatch):
    """Outside the `system` tier, starting a process (but a probe) is an error naming the test."""
    if request.node.get_closest_marker("system"):
        return
    execute = subprocess.Popen._execute_child

    def refuse(*args, **kwargs):
        raise AssertionError(f"{request.node.nodeid} starts a process: mark it `system` "
                             "(pytest.mark.system, or a module's pytestmark)")

    def probes_only(self, args, *rest, **kwargs):
        program = args if isinstance(args, (str, bytes, os.PathLike)) else args[0]
        if Path(os.fsdecode(program).split()[0]).name not in PROBES:
            refuse()
        return execute(self, args, *rest, **kwargs)

    monkeypatch.setattr(subprocess.Popen, "_execute_child", probes_only)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread: on a busy 2-core box OpenMP's spinning threads make each step 4x slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def auto_precision_is_fp32(request, monkeypatch):
    """`precision: auto` (every training stage's default) resolves to fp32 without probing, on every machine:
    on a CPU with bf16 hardware (AVX-512 BF16, AMX) or a GPU it could pick bf16-mixed, and the tests that compare
    exact numbers (accumulation against one batch, resumed against uninterrupted) would then depend on the
    machine. ALIGNFLOW_AUTO_PRECISION=fp32, set when this file loads and again for each test, is read into a run's
    `RunOptions.auto_precision` (flows/options.py), which its stages and ranks get; child processes inherit the
    variable. Tests that create an `Engine` themselves pass `auto_precision="fp32"`. A test marked
    `precision_auto` gets the real resolution.
    (The name is spelled out, so that this file imports nothing of alignflow before the tests do;
    tests/core/train/test_precision.py checks the spelling.)"""
    if request.node.get_closest_marker("precision_auto"):
        monkeypatch.delenv(AUTO_PRECISION_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTO_PRECISION_ENV, "fp32")


@pytest.fixture(autouse=True)
def auto_overlap_is_off(request, monkeypatch):
    """`async_rollouts: auto` (the rl stage's default) stays off: with the tests' one torch thread on a machine
    of two or more cores it would overlap every rl test's rollouts, one step off-policy, and the tests that
    compare exact numbers assume the synchronous stage. ALIGNFLOW_AUTO_OVERLAP=false is inherited by child
    processes; a test marked `overlap_auto` gets the real choice."""
    if request.node.get_closest_marker("overlap_auto"):
        monkeypatch.delenv(AUTO_OVERLAP_ENV, raising=False)
    else:
        monkeypatch.setenv(AUTO_OVERLAP_ENV, "false")


@pytest.fixture(autouse=True)
def local_mlflow(monkeypatch):
    """MLflow goes to the project's SQLite file, never to a server set in the environment."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


def _files(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(folder)): (f.stat().st_size, f.stat().st_mtime_ns) for f in folder.rglob("*")}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """`tiny_model(seed=0, **overrides) -> folder`: `build_tiny` once per session for each arguments.

    Tests and stages only read the folder (a stage writes under its own work folder); the session checks so.
    """
    from alignflow.core.train.models import build_tiny

    built: dict[tuple, tuple[Path, dict]] = {}

    def build(seed: int = 0, **overrides) -> Path:
        key = (seed, tuple(sorted(overrides.items())))
        if key not in built:
            folder = build_tiny(tmp_path_factory.mktemp(f"tiny-{seed}"), seed=seed, **overrides)
            built[key] = folder, _files(folder)
        return built[key][0]

    yield build
    changed = [str(folder) for folder, files in built.values() if _files(folder) != files]
    assert not changed, f"a test wrote into the shared tiny model folders {changed}: copy the folder first"


@pytest.fixture
def sgd_two_micro_batches() -> dict:
    """Stage settings: plain SGD over two micro-batches a step, so the weights move by exactly lr x the
    gradient and two ways of computing the same step (ZeRO stages) must land on the same weights."""
    return {"lr": 0.5, "optimizer": "sgd", "grad_clip": 0.0, "max_steps": 2, "batch_size": 8,
            "micro_batch_size": 4, "lr_scheduler": "constant"}
