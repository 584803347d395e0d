"""LoRA in the sft, preference and rl stages on the tiny model: only adapters train, the reference is the base
with the adapters off (no frozen copy is built), outputs are adapters (or merged weights) that load back, and an
interrupted run resumes to the uninterrupted adapters."""

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import alignflow.flows.stages.preference as preference
import alignflow.flows.stages.rl.setup as rl_setup
import alignflow.flows.stages.rl.stage as rl
from alignflow.core import hookimpl
from alignflow.core.train.adapters import AdaptersOff
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.spec.settings import PolicySettings, RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.offline_loop import split_rows
from alignflow.flows.stages.sft import run_sft
from helpers.plugins import registered
from helpers.stages import no_metrics, stage_context

ADAPTERS = "adapter_model.safetensors"


@pytest.fixture(scope="module")
def files(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("lora")
    data = write_datasets(root / "data")
    out = {"model": tiny_model()}
    for name, n in [("sft", 32), ("pairs", 16)]:
        out[name] = root / f"{name}.jsonl"
        out[name].write_text("\n".join(data[name].read_text().splitlines()[:n]) + "\n")
    out["rl"] = root / "rl.jsonl"
    out["rl"].write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": str(2 * i)}) + "\n" for i in range(4)))
    return out


def ascii_first(prompts, completions, completion_ids, **columns):
    """1 when the completion starts with an ASCII byte (the tiny tokenizer's ids below 128): a reward an
    untrained model gets about half the time, so groups have advantages to learn from."""
    return [float(ids[0] < 128) for ids in completion_ids]


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("ascii_first", ascii_first)


@pytest.fixture(scope="module")
def plugins():
    with registered(Rewards, "test_lora_stages") as p:
        yield p


@pytest.fixture(autouse=True)
def no_frozen_copy(monkeypatch):
    """With LoRA the reference is the policy's base: building a frozen reference is a failure."""
    def refuse(*args, **kwargs):
        raise AssertionError("a frozen reference copy was built")
    monkeypatch.setattr(preference, "frozen", refuse)
    monkeypatch.setattr(rl_setup, "frozen", refuse)


def context(tmp_path, kind, spec: dict, settings, log=None) -> StageContext:
    stage = StageSpec(kind=kind, **spec)
    record = (lambda m, step: log.append((step, m))) if log is not None else no_metrics
    return stage_context(tmp_path, stage, kind, settings=settings, log_metrics=record,
                         inputs={k: Path(v) for k, v in stage.inputs.items()})


def sft_ctx(tmp_path, files, **lora):
    settings = PolicySettings(lr=1e-2, max_steps=3, batch_size=8, micro_batch_size=8, max_length=64,
                              lr_scheduler="constant", lora={"r": 4, **lora})
    spec = {"inputs": {"model": str(files["model"]), "dataset": str(files["sft"])}, "algorithm": "sft"}
    return context(tmp_path, "sft", spec, settings)


def logits(model, text="12+34="):
    ids = torch.tensor([load_tokenizer(model.name_or_path).encode(text)])
    with torch.no_grad():
        return model(ids).logits


def test_sft_saves_adapters_that_load_as_base_plus_adapters(tmp_path, files):
    out = run_sft(sft_ctx(tmp_path / "a", files)).outputs["model"]
    assert (out / "adapter_config.json").is_file() and not (out / "model.safetensors").exists()
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(files["model"])
    saved = load_file(out / ADAPTERS)
    assert saved and all("lora_" in k for k in saved)  # no base weight: adapters only
    assert any(v.abs().sum() > 0 for k, v in saved.items() if "lora_B" in k)  # B left zero would be no training
    tuned, base = load_model(out), load_model(files["model"])
    assert (logits(tuned) - logits(base)).abs().max() > 1e-3
    # what no adapter touches is the base's, bit for bit: embeddings (= the tied head) and norms
    t, b = tuned.state_dict(), base.state_dict()
    for k in b:
        if "proj" not in k:
            assert torch.equal(t[k], b[k]), k


def test_sft_merge_writes_the_merged_model_and_keeps_the_adapters(tmp_path, files):
    out = run_sft(sft_ctx(tmp_path / "m", files, merge=True)).outputs["model"]
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "adapter" / ADAPTERS).is_file()
    torch.testing.assert_close(logits(load_model(out)), logits(load_model(out / "adapter")), rtol=0, atol=1e-5)
    assert load_tokenizer(out).encode("1+1=") == load_tokenizer(files["model"]).encode("1+1=")


def dpo_ctx(tmp_path, files, log):
    settings = PolicySettings(lr=1e-2, max_steps=4, batch_size=4, micro_batch_size=2, max_length=64, save_every=2,
                              log_every=1, lr_scheduler="linear", lora={"r": 4})
    spec = {"inputs": {"model": str(files["model"]), "dataset": str(files["pairs"])},
            "algorithm": {"name": "dpo", "config": {"beta": 0.1}}}
    return context(tmp_path, "preference", spec, settings, log)


class Crash(Exception):
    pass


def test_dpo_reference_is_the_base_and_resume_gives_the_same_adapters(tmp_path, files):
    log = []
    ctx = dpo_ctx(tmp_path / "a", files, log)
    whole = preference.run_preference(ctx)
    first = next(m for s, m in log if s == 1 and "loss" in m)
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-5)  # fresh adapters: policy = reference, margin 0
    # the cached reference log-probs are the base model's own
    tok = load_tokenizer(files["model"])
    train, _ = split_rows(ctx, tok, "pairwise", None)
    want = preference.reference_logps(load_model(files["model"]).eval(), train, ["chosen", "rejected"], 2,
                                      tok.pad_token_id, torch.device("cpu"))
    cache = torch.load(ctx.checkpoint_dir / preference.REFERENCE_CACHE)["train"]
    for name in ("chosen", "rejected"):
        torch.testing.assert_close(cache[name], want[name], rtol=0, atol=1e-5)

    def crash(metrics, step):
        if step == 3:
            raise Crash  # after step 3's update, before its checkpoint: resumes from step 2
    broken = dpo_ctx(tmp_path / "b", files, None)
    broken.log_metrics = crash
    with pytest.raises(Crash):
        preference.run_preference(broken)
    log = []
    resumed = preference.run_preference(dpo_ctx(tmp_path / "b", files, log))
    assert [s for s, m in log if "loss" in m] == [3, 4]
    a, b = load_file(whole.outputs["model"] / ADAPTERS), load_file(resumed.outputs["model"] / ADAPTERS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def rl_ctx(tmp_path, files, log, **settings):
    base = dict(max_steps=2, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-2, save_every=1,
                generation={"max_new_tokens": 6}, lora={"r": 4})
    spec = {"inputs": {"model": str(files["model"]), "dataset": str(files["rl"])}, "algorithm": "grpo",
            "rewards": ["ascii_first"], "sampler": "hf"}
    return context(tmp_path, "rl", spec, RLSettings(**{**base, **settings}), log)


def test_grpo_reference_log_probs_are_the_base_models(tmp_path, files, plugins, monkeypatch):
    calls = []

    class Recording(AdaptersOff):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            calls.append((args, kwargs, out.logits.detach().clone()))
            return out

    monkeypatch.setattr(rl, "AdaptersOff", Recording)
    log = []
    result = rl.run_rl(rl_ctx(tmp_path, files, log))
    steps = [m for s, m in log[:-1]]
    assert len(steps) == 2 and steps[0]["actor/kl_ref_k3"] == pytest.approx(0.0, abs=1e-7)  # policy = base
    assert steps[1]["actor/kl_ref_k3"] > 0  # after one update the adapters moved the policy off its base
    base = load_model(files["model"]).eval()
    assert len(calls) >= 2  # the reference's forwards of both steps
    with torch.no_grad():
        for args, kwargs, got in calls:
            torch.testing.assert_close(got, base(*args, **kwargs).logits, rtol=0, atol=1e-5)
    assert (result.outputs["model"] / "adapter_config.json").is_file()


def test_grpo_resume_gives_the_uninterrupted_adapters(tmp_path, files, plugins):
    whole = rl.run_rl(rl_ctx(tmp_path / "a", files, [], max_steps=3))

    def crash(metrics, step):
        if step == 2:
            raise Crash
    ctx = rl_ctx(tmp_path / "b", files, None, max_steps=3)
    ctx.log_metrics = crash
    with pytest.raises(Crash):
        rl.run_rl(ctx)
    log = []
    resumed = rl.run_rl(rl_ctx(tmp_path / "b", files, log, max_steps=3))
    assert [step for step, _ in log[:-1]] == [2, 3]
    a, b = load_file(whole.outputs["model"] / ADAPTERS), load_file(resumed.outputs["model"] / ADAPTERS)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_zero2_and_zero3_train_the_adapters_zero0_does(tmp_path, files, sgd_two_micro_batches):
    """Frozen base weights under ZeRO-2 (sharded optimizer state and gradients of the adapters only) and ZeRO-3
    (every weight sharded, gathered for the forward, the save and the merge): SGD, so the adapters move by
    exactly lr x the same gradient."""
    out = {}
    for zero in (0, 2, 3):
        settings = PolicySettings(**sgd_two_micro_batches, max_length=64, zero_stage=zero, lora={"r": 4, "merge": True})
        spec = {"inputs": {"model": str(files["model"]), "dataset": str(files["sft"])}, "algorithm": "sft"}
        model = run_sft(context(tmp_path / f"z{zero}", "sft", spec, settings)).outputs["model"]
        out[zero] = load_file(model / "adapter" / ADAPTERS), load_file(model / "model.safetensors")
    for zero in (2, 3):
        for mine, ref in zip(out[zero], out[0]):
            assert mine.keys() == ref.keys()
            for k in ref:
                torch.testing.assert_close(mine[k], ref[k], rtol=0, atol=1e-6)
    assert any(v.abs().sum() > 0 for k, v in out[3][0].items() if "lora_B" in k)
