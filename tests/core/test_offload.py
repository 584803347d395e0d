"""ZeRO CPU offload: the DeepSpeed config it makes, the combinations refused, and that it trains as without it."""

from __future__ import annotations

import pytest
import torch
import yaml

from helpers import engine_worker as worker
from alignflow.core.rl.aggregation import aggregate
from alignflow.core.train.engine import Engine, frozen
from alignflow.core.train.optim import ds_config
from alignflow.core.errors import SpecError
from alignflow.core.spec.settings import TrainSettings
from alignflow.core.spec.schema import parse_spec


def zero_section(**settings) -> dict:
    return ds_config(TrainSettings(**settings), world_size=1, num_params=1000)["zero_optimization"]


def test_offload_settings_become_deepspeeds_offload_sections():
    assert "offload_optimizer" not in zero_section(zero_stage=2) and "offload_param" not in zero_section(zero_stage=3)
    assert zero_section(zero_stage=2, offload_optimizer="cpu")["offload_optimizer"] == {"device": "cpu",
                                                                                         "pin_memory": True}
    both = zero_section(zero_stage=3, offload_optimizer="cpu", offload_params="cpu")
    assert both["offload_optimizer"] == both["offload_param"] == {"device": "cpu", "pin_memory": True}
    # torch's AdamW steps the offloaded partitions: DeepSpeed must not insist on its JIT-built DeepSpeedCPUAdam
    assert ds_config(TrainSettings(), 1, 1000)["zero_force_ds_cpu_optimizer"] is False


def spec_error(settings: str) -> str:
    raw = yaml.safe_load(f"""
name: m
stages:
  big:
    kind: sft
    inputs: {{model: "builtin:tiny", dataset: d.jsonl}}
    algorithm: sft
    settings: {settings}
""")
    with pytest.raises(SpecError) as info:
        parse_spec(raw, "m.yaml")
    return str(info.value)


@pytest.mark.parametrize("settings,expected", [
    ("{zero_stage: 2, offload_optimizer: cpu, offload_params: cpu}",
     "stage 'big', settings.offload_params: Value error, offload_params: cpu needs zero_stage 3 "
     "(only ZeRO-3 partitions the weights); got zero_stage 2"),
    ("{offload_optimizer: cpu}", "stage 'big', settings.offload_optimizer: Value error, offload_optimizer: cpu needs "
     "zero_stage 1, 2 or 3"),
    ("{zero_stage: 3, offload_params: cpu}", "stage 'big', settings.offload_params: Value error, offload_params: "
     "cpu needs offload_optimizer: cpu too"),
    ("{zero_stage: 3, offload_optimizer: nvme}", "stage 'big', settings.offload_optimizer: Input should be 'none' "
     "or 'cpu'"),
])
def test_combinations_deepspeed_cannot_run_are_refused_naming_stage_and_field(settings, expected):
    assert expected in spec_error(settings)


def train(steps: int = 3, **settings) -> tuple[dict, Engine]:
    model = worker.tiny_model()
    engine = Engine.create(model, TrainSettings(batch_size=8, micro_batch_size=4, lr=1e-2, **settings), steps,
                           auto_precision="fp32")
    ids, mask = worker.dataset(8)
    for _ in engine.steps():
        norm = engine.step_norm([mask[:4], mask[4:]])
        for m in (slice(0, 4), slice(4, 8)):
            per_token = worker.per_token_loss(engine.model, ids[m], torch.ones(4, device=engine.device))
            engine.backward(aggregate(per_token, mask[m], "token-mean", norm))
        engine.step()
    return engine.full_state_dict(), engine


@pytest.mark.parametrize("offload", [{"zero_stage": 2, "offload_optimizer": "cpu"},
                                     {"zero_stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"}])
def test_offloaded_training_ends_with_the_weights_of_training_without_it(offload):
    """Same fp32 gradients, same AdamW arithmetic on the CPU-held partitions: the same weights (here bit for bit)."""
    expected, _ = train(zero_stage=offload["zero_stage"])
    weights, engine = train(**offload)
    assert engine.ds.zero_cpu_offload()  # DeepSpeed did place the optimizer on the CPU
    if "offload_params" in offload:
        assert engine.ds.zero_offload_param() is not None
    for name, w in expected.items():
        torch.testing.assert_close(weights[name], w, rtol=0, atol=0)
    assert any(not torch.equal(w, worker.tiny_model().state_dict()[k]) for k, w in weights.items())  # it trained


def test_a_zero3_reference_with_offloaded_params_gives_the_models_outputs():
    """frozen() builds its ZeRO-3 engine from the same config: weights offloaded, no optimizer, same logits."""
    model = worker.tiny_model()
    ids, _ = worker.dataset(2)
    expected = model(ids)
    ref = frozen(model, TrainSettings(zero_stage=3, offload_optimizer="cpu", offload_params="cpu"))
    with torch.no_grad():
        torch.testing.assert_close(ref(ids), expected, rtol=0, atol=0)
