"""Stages in a child process: results, metrics and errors come back; plugins are rebuilt or refused."""

import multiprocessing
import threading
import time

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core import hookimpl
from alignflow.core.errors import SpecError
from alignflow.core.plugins import Plugins, get_plugins
from alignflow.core.settings import TrainSettings
from alignflow.core.spec import parse_spec
from alignflow.core.task import write_datasets
from alignflow.flows.child import ChildFailed, plugin_recipe, run_in_child
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


def test_a_child_gives_the_result_and_metrics_of_a_run_here(tmp_path, data):
    here_ctx, here_logged = context(tmp_path / "here", data, max_steps=4)
    here = run_sft(here_ctx)
    child_ctx, child_logged = context(tmp_path / "child", data, max_steps=4)
    child = run_in_child("sft", child_ctx)
    assert child.metrics == here.metrics and child.headline == here.headline
    assert child_logged == here_logged and {2, 4} <= {s for s, _ in child_logged}
    a, b = (load_file(r.outputs["model"] / "model.safetensors") for r in (here, child))
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_child_raises_what_the_runner_raised(tmp_path, data):
    ctx, _ = context(tmp_path, data, model="builtin:nope", max_steps=2)
    with pytest.raises(SpecError, match="unknown built-in model 'nope'") as info:
        run_in_child("sft", ctx)
    assert any("in the stage's process" in note for note in info.value.__notes__)


def test_a_killed_child_is_a_clear_failure(tmp_path, data):
    ctx, _ = context(tmp_path, data, max_steps=100_000)
    outcome = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("error", _raises(run_in_child, "sft", ctx)))
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
