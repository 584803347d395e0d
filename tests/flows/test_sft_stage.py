"""The sft stage: accumulation gives the big-batch step, and the loss falls on the bundled task."""

import math

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.stages.sft import run_sft
from helpers.stages import stage_context


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft-data")
    rows = (write_datasets(root)["sft"]).read_text().splitlines()[:64]
    path = root / "small.jsonl"
    path.write_text("\n".join(rows) + "\n")
    return path


def run(tmp_path, data, name, **settings):
    spec = parse_spec({"name": "s", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": str(data)}, "algorithm": "sft",
        "settings": {"lr": 1e-3, "max_length": 64, "save_every": 100, "lr_scheduler": "constant", **settings}}}})
    result = run_sft(stage_context(tmp_path / name, spec, settings_model=TrainSettings))
    return result, load_file(result.outputs["model"] / "model.safetensors")


def test_accumulation_equals_one_big_batch(tmp_path, data):
    """Four micro-batches of 4 uneven rows take the same optimizer step as one micro-batch of 16.

    Adam's first step is lr * g / (|g| + eps): rounding in gradients near eps moves a weight by up to
    about lr, so the bound is 1% of lr, far below what per-micro-batch normalisation changes.
    """
    _, big = run(tmp_path, data, "big", max_steps=1, batch_size=16, micro_batch_size=16)
    _, small = run(tmp_path, data, "small", max_steps=1, batch_size=16, micro_batch_size=4)
    assert big.keys() == small.keys()
    for key in big:
        torch.testing.assert_close(small[key], big[key], rtol=0, atol=1e-5)


def test_loss_falls_and_metrics_are_reported(tmp_path, data):
    result, _ = run(tmp_path, data, "train", max_steps=12, batch_size=16, micro_batch_size=16, eval_fraction=0.25)
    m = result.metrics
    assert m["steps"] == 12 and result.headline == "train/loss"
    uniform = math.log(264)  # the untrained model's loss is about this: uniform over the vocabulary
    assert m["train/loss"] < 0.75 * uniform
    assert m["eval/loss"] < 0.75 * uniform  # held-out rows (a quarter of them) improve too


def test_model_options_reach_the_loaders(tmp_path, data):
    """settings.model picks the attention implementation and the chat template of the stage's model."""
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    spec = parse_spec({"name": "s", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": str(data)}, "algorithm": "sft",
        "settings": {"model": {"attn_implementation": "eager", "chat_template": template}}}}})
    ctx = stage_context(tmp_path, spec, settings_model=TrainSettings)
    from alignflow.flows.stages.training import load_model_for, load_tokenizer_for, model_source

    with model_source(ctx) as src:
        model, tokenizer = load_model_for(ctx, src), load_tokenizer_for(ctx, src)
    assert model.config._attn_implementation == "eager"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"
