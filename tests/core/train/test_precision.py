"""The `precision` setting: the old `dtype` spelling, resolving `auto` (hardware, the probe), the engine's autocast
and DeepSpeed's bf16 mode, frozen models under bf16-mixed, and the manifest's entries."""

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from alignflow.core import fingerprint as fp
from alignflow.core.spec.settings import RLSettings, TrainSettings
from alignflow.core.train import precision
from alignflow.core.train.engine import Engine, frozen
from alignflow.core.train.models import load_model
from alignflow.flows.options import AUTO_PRECISION_ENV, RunOptions

CONFTEST = Path(__file__).resolve().parents[2] / "conftest.py"


def test_dtype_is_the_old_spelling_of_precision():
    assert TrainSettings().precision == "auto"
    assert TrainSettings(dtype="bf16").precision == "bf16"
    assert RLSettings.model_validate({"dtype": "fp32"}).precision == "fp32"
    assert TrainSettings(dtype="bf16", precision="bf16").precision == "bf16"  # the same, said twice
    assert TrainSettings(precision="bf16-mixed").weight_dtype == "fp32"
    assert TrainSettings(precision="bf16").weight_dtype == "bf16"


def test_dtype_and_precision_that_disagree_are_refused_by_name():
    with pytest.raises(ValidationError, match="dtype: bf16 and precision: bf16-mixed disagree"):
        TrainSettings(dtype="bf16", precision="bf16-mixed")
    with pytest.raises(ValidationError, match="dtype: 'fp16' is not fp32 or bf16"):
        TrainSettings(dtype="fp16")


def test_the_suite_makes_auto_fp32_under_the_options_variable():
    assert f'AUTO_PRECISION_ENV = "{AUTO_PRECISION_ENV}"' in CONFTEST.read_text()
    assert RunOptions.from_env().auto_precision == "fp32"
    assert precision.resolve(TrainSettings(), torch.nn.Linear(2, 2), "fp32") == (
        "fp32", None, "auto, the run's auto_precision=fp32")


@pytest.mark.precision_auto
def test_the_runs_value_decides_auto_not_the_environment_at_stage_time(cpu, monkeypatch):
    cpu(False)
    monkeypatch.setattr(precision, "probe", None)
    monkeypatch.setenv(AUTO_PRECISION_ENV, "bf16-mixed")
    linear = torch.nn.Linear(2, 2)
    assert precision.resolve(TrainSettings(), linear).precision == "fp32"  # the hardware's answer
    monkeypatch.setenv(AUTO_PRECISION_ENV, "fp32")
    assert precision.resolve(TrainSettings(), linear, "bf16-mixed").precision == "bf16-mixed"
    with pytest.raises(ValueError, match="'bf16': expected fp32 or bf16-mixed"):
        precision.resolve(TrainSettings(), linear, "bf16")


@pytest.mark.parametrize("value", ["fp32", "bf16-mixed", "bf16"])
def test_a_set_precision_passes_through_without_a_probe(value, monkeypatch):
    monkeypatch.setattr(precision, "probe", None)  # calling it would fail
    assert precision.resolve(TrainSettings(precision=value), torch.nn.Linear(2, 2)).precision == value


@pytest.fixture
def cpu(monkeypatch):
    """`auto` on a CPU (even on a GPU machine), with or without bf16 hardware as the test says."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def with_bf16(has: bool):
        monkeypatch.setattr(precision, "cpu_has_bf16", lambda: has)

    return with_bf16


@pytest.mark.precision_auto
def test_auto_on_a_cpu_without_bf16_is_fp32_without_a_probe(cpu, monkeypatch, tiny_model):
    cpu(False)
    monkeypatch.setattr(precision, "probe", None)
    assert precision.resolve(TrainSettings(), load_model(tiny_model())).precision == "fp32"


@pytest.mark.precision_auto
@pytest.mark.parametrize("bf16_s, expected", [(0.089, "bf16-mixed"), (0.091, "fp32")])
def test_auto_on_a_bf16_cpu_takes_bf16_mixed_when_the_probe_is_10_percent_faster(cpu, monkeypatch, tiny_model,
                                                                                  bf16_s, expected):
    cpu(True)
    seen = []

    def probe(model, rows, length, vocab):
        seen.append((rows, length, vocab))
        return {"fp32": 0.1, "bf16-mixed": bf16_s}

    monkeypatch.setattr(precision, "probe", probe)
    model = load_model(tiny_model())
    got = precision.resolve(TrainSettings(micro_batch_size=4, max_length=128), model)
    assert got.precision == expected and got.probe_s == {"fp32": 0.1, "bf16-mixed": bf16_s}
    assert seen == [(4, 128, model.config.vocab_size)]


@pytest.mark.precision_auto
def test_auto_skips_the_probe_of_a_large_model_and_of_one_without_a_vocabulary(cpu, monkeypatch, tiny_model):
    cpu(True)
    monkeypatch.setattr(precision, "probe", None)
    assert precision.resolve(TrainSettings(), torch.nn.Linear(2, 2)).precision == "fp32"  # nothing to probe with
    monkeypatch.setattr(precision, "PROBE_MAX_PARAMS", 1000)
    got = precision.resolve(TrainSettings(), load_model(tiny_model()))
    assert got.precision == "bf16-mixed" and got.probe_s is None


def one_step(model, ids):
    engine = Engine.create(model, TrainSettings(precision="fp32", batch_size=2, micro_batch_size=2, lr=1e-2), 1)
    engine.backward(engine.model(input_ids=ids, labels=ids).loss)
    engine.step()
    return engine.full_state_dict()


def test_the_probe_leaves_grads_rng_and_the_next_training_step_as_they_were(tiny_model):
    probed, plain = load_model(tiny_model()), load_model(tiny_model())
    marker = torch.full_like(next(probed.parameters()), 0.5)
    next(probed.parameters()).grad = marker
    rng = torch.get_rng_state()
    times = precision.probe(probed, micro_batch_size=4, max_length=16, vocab=probed.config.vocab_size)
    assert set(times) == {"fp32", "bf16-mixed"} and all(t > 0 for t in times.values())
    assert torch.equal(torch.get_rng_state(), rng)
    assert next(probed.parameters()).grad is marker
    assert all(p.grad is None for p in list(probed.parameters())[1:])
    next(probed.parameters()).grad = None
    ids = torch.randint(4, 200, (2, 12))
    after, without = one_step(probed, ids), one_step(plain, ids)
    assert all(torch.equal(after[k], without[k]) for k in without)


@pytest.mark.parametrize("value, weights, out, ds_bf16", [("fp32", torch.float32, torch.float32, False),
                                                          ("bf16-mixed", torch.float32, torch.bfloat16, False),
                                                          ("bf16", torch.bfloat16, torch.bfloat16, True)])
def test_engine_autocast_and_deepspeed_follow_the_precision(value, weights, out, ds_bf16):
    engine = Engine.create(torch.nn.Linear(4, 2), TrainSettings(precision=value, batch_size=1, micro_batch_size=1), 1)
    assert engine.precision == value and engine.ds.bfloat16_enabled() == ds_bf16
    assert next(engine.module.parameters()).dtype == weights
    with engine.autocast():
        y = engine.model(torch.ones(1, 4, device=engine.device, dtype=weights))
    assert y.dtype == out
    assert engine.fingerprint() == {"precision": value, "precision_setting": value, "precision_probe_s": None}


def test_auto_is_recorded_resolved_beside_the_setting():
    engine = Engine.create(torch.nn.Linear(4, 2), TrainSettings(batch_size=1, micro_batch_size=1), 1,
                           auto_precision="fp32")
    assert engine.fingerprint() == {"precision": "fp32", "precision_setting": "auto", "precision_probe_s": None}
    assert fp.fingerprint(TrainSettings())["precision"] is None  # before the run: not resolved yet
    assert fp.fingerprint(TrainSettings(precision="bf16"))["precision"] == "bf16"


def test_a_frozen_model_under_bf16_mixed_keeps_fp32_weights_and_scores_as_the_policy(tiny_model):
    settings = TrainSettings(precision="bf16-mixed", batch_size=2, micro_batch_size=2)
    engine = Engine.create(load_model(tiny_model()), settings, 1)
    ref = engine.match(frozen(load_model(tiny_model()), settings))
    assert next(ref.parameters()).dtype == torch.float32
    assert ref.config._attn_implementation == engine.module.config._attn_implementation == "eager"  # fit_attention
    ids = torch.randint(4, 200, (2, 12), device=engine.device)
    with torch.no_grad(), engine.autocast():
        ours, theirs = engine.model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)


def test_measured_entries_are_not_environment_differences():
    a = {"precision": "bf16-mixed", "precision_probe_s": {"fp32": 0.1, "bf16-mixed": 0.05}}
    b = {"precision": "bf16-mixed", "precision_probe_s": {"fp32": 0.2, "bf16-mixed": 0.06}}
    assert fp.differences(a, b) == {}
    assert fp.differences(a, {**b, "precision": "fp32"}) == {"precision": ("bf16-mixed", "fp32")}


def test_eager_attention_only_under_bf16_mixed_on_a_cpu_for_short_sequences(tiny_model):
    from alignflow.core.spec.settings import ModelOptions
    from alignflow.core.train.precision import fit_attention

    def after(resolved, **kw):
        model = load_model(tiny_model())
        assert model.config._attn_implementation == "sdpa"
        fit_attention(model, resolved, TrainSettings(**kw))
        return model.config._attn_implementation

    assert after("bf16-mixed") == "eager"
    assert after("fp32") == after("bf16") == "sdpa"
    assert after("bf16-mixed", max_length=1024) == "sdpa"  # long sequences: torch's kernel is as fast
    assert after("bf16-mixed", model=ModelOptions(attn_implementation="sdpa")) == "sdpa"  # the user's choice
