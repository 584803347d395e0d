"""The rl stage on two threads gives the same bits whatever else the machine runs: a rerun of a recorded run on the
machine that made it must match exactly (`alignflow reproduce`), and resume relies on it too."""

import json

import pytest
import torch

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.settings import RLSettings
from alignflow.core.train.models import load_model
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from helpers.load import busy_loops, torch_threads

pytestmark = pytest.mark.system  # busy loops are processes


def grpo(root, model, dataset):
    """GRPO, 16 prompts x 8 completions a step in micro-batches of 64: packed rows share each group's prompt."""
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(dataset)}, algorithm="grpo",
                     rewards=[{"name": "length", "config": {"target": 4}}], sampler="hf")
    settings = RLSettings(max_steps=3, prompts_per_step=16, group_size=8, micro_batch_size=64, lr=1e-3,
                          save_every=10, generation={"max_new_tokens": 16, "temperature": 1.0})
    (root / "work").mkdir(parents=True)
    ctx = StageContext("grpo", spec, settings, {"model": model, "dataset": dataset}, root / "work",
                       root / "checkpoints", 0, lambda m, step: None, get_plugins())
    return load_model(run_rl(ctx).outputs["model"]).state_dict()


def test_grpo_twice_on_two_threads_once_beside_busy_loops_ends_bit_identical(tmp_path, tiny_model):
    data = tmp_path / "rl.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i + 1}=", "answer": str(2 * i + 1)}) + "\n"
                            for i in range(16)))
    model = tiny_model()
    with torch_threads(2):
        quiet = grpo(tmp_path / "quiet", model, data)
        with busy_loops(4):
            loaded = grpo(tmp_path / "loaded", model, data)
    assert quiet.keys() == loaded.keys()
    assert [k for k in quiet if not torch.equal(quiet[k], loaded[k])] == []
