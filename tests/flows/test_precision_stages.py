"""Stages under `precision: bf16-mixed` on the tiny model: sft learns, and where the policy is its reference
(DPO's first step, an rl stage's first rollout) both score alike, so the first margin and KL are 0 exactly."""

import json
import math
import os
from dataclasses import replace

import pytest

from alignflow.core.spec.schema import StageSpec, parse_spec
from alignflow.core.spec.settings import RLSettings, TrainSettings
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.options import AUTO_PRECISION_ENV, RunOptions
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.preference import run_preference
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.sft import run_sft
from helpers.stages import stage_context

MIXED = {"precision": "bf16-mixed", "lr": 1e-3, "max_length": 64, "save_every": 100, "log_every": 1,
         "lr_scheduler": "constant"}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision-data")
    written = write_datasets(root)
    out = {}
    for name, n in [("sft", 64), ("pairs", 4)]:
        out[name] = root / f"small-{name}.jsonl"
        out[name].write_text("\n".join(written[name].read_text().splitlines()[:n]) + "\n")
    return out


def logged_run(runner, tmp_path, spec, settings_model):
    logged = []
    ctx = stage_context(tmp_path, spec, settings_model=settings_model, log_metrics=lambda m, s: logged.append((s, m)))
    return runner(ctx), logged


def test_sft_in_bf16_mixed_learns_and_records_its_precision(tmp_path, data):
    spec = parse_spec({"name": "s", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": str(data["sft"])}, "algorithm": "sft",
        "settings": {**MIXED, "max_steps": 12, "batch_size": 16, "micro_batch_size": 16}}}})
    result, logged = logged_run(run_sft, tmp_path, spec, TrainSettings)
    losses = [m["loss"] for _, m in logged if "loss" in m]
    assert losses[-1] < 0.75 * math.log(264) < losses[0]  # from about uniform over the vocabulary
    assert result.fingerprint == {"precision": "bf16-mixed", "precision_setting": "bf16-mixed",
                                  "precision_probe_s": None}


def test_auto_trains_in_the_runs_auto_precision_whatever_the_environment_says(tmp_path, data):
    """The suite's environment says fp32 (conftest.py); the run's options, as its ranks get them, say bf16-mixed."""
    spec = parse_spec({"name": "s", "stages": {"sft": {
        "kind": "sft", "inputs": {"model": "builtin:tiny", "dataset": str(data["sft"])}, "algorithm": "sft",
        "settings": {**MIXED, "precision": "auto", "max_steps": 1, "batch_size": 4, "micro_batch_size": 4}}}})
    ctx = replace(stage_context(tmp_path, spec, settings_model=TrainSettings),
                  options=RunOptions(auto_precision="bf16-mixed"))
    assert os.environ[AUTO_PRECISION_ENV] == "fp32"
    assert run_sft(ctx).fingerprint == {"precision": "bf16-mixed", "precision_setting": "auto",
                                        "precision_probe_s": None}


def test_dpo_in_bf16_mixed_starts_at_margin_zero(tmp_path, data, tiny_model):
    """One micro-batch of all 4 pairs, as the reference cache scores them: the same padded width. (Other rows
    beside a sequence change its padding, and bf16's rounding then moves a log-prob by ~1e-4.)"""
    spec = parse_spec({"name": "p", "stages": {"pref": {
        "kind": "preference", "inputs": {"model": str(tiny_model()), "dataset": str(data["pairs"])},
        "algorithm": "dpo", "settings": {**MIXED, "max_steps": 1, "batch_size": 4, "micro_batch_size": 4}}}})
    _, logged = logged_run(run_preference, tmp_path, spec, TrainSettings)
    first = next(m for s, m in logged if s == 1 and "loss" in m)
    assert first["rewards/margins"] == 0.0 and first["loss"] == pytest.approx(math.log(2), abs=1e-6)


def test_rl_in_bf16_mixed_starts_at_kl_zero(tmp_path, tiny_model):
    rows = tmp_path / "rl.jsonl"
    rows.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    model = tiny_model()
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(rows)},
                     algorithm="grpo", rewards=["math_accuracy"], sampler="hf")
    # pi_old recomputed by the trainer (the hf sampler scores in fp32), so that it and the reference run alike
    settings = RLSettings(precision="bf16-mixed", max_steps=1, prompts_per_step=2, group_size=4, micro_batch_size=4,
                          lr=1e-3, generation={"max_new_tokens": 4}, recompute_old_logprobs=True)
    (tmp_path / "work").mkdir()
    logged = []
    from alignflow.core.plugins import get_plugins

    ctx = StageContext("rl", spec, settings, {"model": model, "dataset": rows}, tmp_path / "work",
                       tmp_path / "checkpoints", 0, lambda m, s: logged.append((s, m)), get_plugins())
    result = run_rl(ctx)
    assert logged[0][1]["actor/kl_ref_k3"] == 0.0
    assert result.fingerprint["precision"] == "bf16-mixed"
