"""The reward_model stage: the margin column reaches the loss, and the `reward_model` reward loads the
output, scores exactly what the stage trained on, and ranks held-out pairs as the stage reported."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import alignflow.plugins.bradley_terry
from alignflow.core.plugins import Plugins
from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.stages.reward_model import run_reward_model
from helpers.stages import stage_context
from alignflow.plugins.reward_model import RewardModel


def pairs(n: int, offset: int) -> list[dict]:
    """Pairs a tiny model separates in a few steps: the chosen answer is "yes", the rejected "no"."""
    return [{"prompt": f"{a}+{a}=", "chosen": "<answer>yes</answer>", "rejected": "<answer>no</answer>",
             "margin": 1.0} for a in range(offset, offset + n)]


def write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_trained_model_loads_in_the_reward_and_ranks_held_out_pairs(tmp_path, tiny_model):
    plugs = Plugins()
    plugs.add(alignflow.plugins.bradley_terry, "bradley_terry")
    held_out = pairs(8, 100)
    inputs = {"model": tiny_model(), "dataset": write(tmp_path / "train.jsonl", pairs(32, 0)),
              "eval_dataset": write(tmp_path / "eval.jsonl", held_out)}
    spec = parse_spec({"name": "rm", "stages": {"rm": {
        "kind": "reward_model", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": "bradley_terry",
        "settings": {"lr": 3e-3, "max_steps": 8, "batch_size": 8, "micro_batch_size": 4, "max_length": 64,
                     "log_every": 1, "lr_scheduler": "constant"}}}}, plugins=plugs)
    logged = []
    result = run_reward_model(stage_context(tmp_path, spec, settings_model=TrainSettings, inputs=inputs, plugins=plugs,
                                            log_metrics=lambda m, s: logged.append((s, m))))

    # a causal LM's fresh head is zero, so every score is 0 and each pair loses -log sigma(0 - margin)
    first = next(m for s, m in logged if s == 1)
    assert first["loss"] == pytest.approx(math.log1p(math.exp(1.0)), abs=1e-6)
    reward = RewardModel(RewardModel.Config(path=str(result.outputs["model"])))
    chosen = reward([r["prompt"] for r in held_out], [r["chosen"] for r in held_out])
    rejected = reward([r["prompt"] for r in held_out], [r["rejected"] for r in held_out])
    accuracy = sum(c > r for c, r in zip(chosen, rejected)) / len(held_out)
    assert accuracy == result.metrics["eval/accuracy"] == 1.0
    # the reward scores the same text at the same token as the stage: the held-out margins agree
    margins = sum(c - r for c, r in zip(chosen, rejected)) / len(held_out)
    assert margins == pytest.approx(result.metrics["eval/rewards/margins"], rel=1e-4)
    assert result.headline == "eval/accuracy"


def test_zero3_takes_the_zero0_steps(tmp_path, sgd_two_micro_batches, tiny_model):
    """Two micro-batches a step under ZeRO-3 give ZeRO-0's update. SGD: the weights move by exactly
    lr x the gradient (Adam's first steps move near-zero gradients by ~lr either way). Before the value
    model ran through the engine's forward, ZeRO-3 moved the score head a third off."""
    plugs = Plugins()
    plugs.add(alignflow.plugins.bradley_terry, "bradley_terry")
    inputs = {"model": tiny_model(), "dataset": write(tmp_path / "train.jsonl", pairs(16, 0))}
    out = {}
    for zero in (0, 3):
        spec = parse_spec({"name": "rm", "stages": {"rm": {
            "kind": "reward_model", "inputs": {k: str(v) for k, v in inputs.items()}, "algorithm": "bradley_terry",
            "settings": {**sgd_two_micro_batches, "max_length": 64, "zero_stage": zero}}}}, plugins=plugs)
        run = tmp_path / f"zero{zero}"  # the engine keeps its checkpoints beside checkpoint_dir
        ctx = stage_context(run, spec, settings_model=TrainSettings, inputs=inputs, plugins=plugs)
        out[zero] = load_file(run_reward_model(ctx).outputs["model"] / "model.safetensors")
    assert out[0].keys() == out[3].keys() and "score.weight" in out[0]
    for k in out[0]:
        torch.testing.assert_close(out[3][k], out[0][k], rtol=1e-4, atol=1e-6)
