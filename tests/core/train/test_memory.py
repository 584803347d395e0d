"""Memory estimates: parameter counts from configs alone, and DeepSpeed's own ZeRO estimators, figure for figure."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from alignflow.core.errors import AlignflowError
from alignflow.core.train.memory import Counts, count_parameters, gib, model_states, parse_size, stage_memory
from alignflow.core.plugins import get_plugins
from alignflow.core.spec.settings import LoraSettings
from alignflow.core.spec.schema import parse_spec, resolved_stages

# Qwen2.5-0.5B-Instruct's config.json (the architecture fields)
QWEN05 = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864,
          "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
          "tie_word_embeddings": True, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
          "rope_theta": 1000000.0, "hidden_act": "silu", "use_sliding_window": False}
# By hand: embeddings 151936 x 896 = 136,134,656 (tied: the head is the same tensor, counted once). A layer:
# q 896x896+896 = 803,712; k and v 896x128+128 = 114,816 each; o 896x896 = 802,816; MLP 3 x 896x4864 =
# 13,074,432; two RMSNorms 1,792: 14,912,384, x24 = 357,897,216. Final norm 896. Sum 494,032,768, the published
# 0.49B. The largest module is the embedding.
QWEN05_PARAMS, QWEN05_LARGEST = 494_032_768, 136_134_656


@pytest.fixture(scope="module")
def qwen05(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("qwen05")
    (folder / "config.json").write_text(json.dumps(QWEN05))
    return folder


def test_tiny_and_a_real_config_are_counted_without_weights(qwen05):
    # builtin:tiny: embeddings 264 x 128 = 33,792; a layer: q 128x128+128 = 16,512, k and v 128x64+64 = 8,256 each,
    # o 16,384, MLP 3 x 128x512 = 196,608, norms 256: 246,272, x4 = 985,088; final norm 128: 1,019,008.
    assert count_parameters("builtin:tiny") == Counts(1_019_008, 128 * 512)
    assert count_parameters(qwen05) == Counts(QWEN05_PARAMS, QWEN05_LARGEST)
    # a value model: the head is 896 -> 1 (no bias) in place of the tied LM head
    assert count_parameters(qwen05, value_head=True).total == QWEN05_PARAMS + 896


@pytest.mark.stage
def test_lora_counts_only_the_adapters(qwen05):
    # r=8 on every linear layer but the head: r x (in + out) each. A layer: q 8x(896+896) = 14,336, k and v
    # 8x(896+128) = 8,192 each, o 14,336, gate and up 8x(896+4864) = 46,080 each, down 46,080: 183,296, x24.
    counts = count_parameters(qwen05, lora=LoraSettings(r=8))
    assert counts.total == 183_296 * 24 == 4_399_104
    assert counts.largest_layer == 8 * 4864  # lora_B of gate/up: [4864, 8]


def test_a_hub_id_not_in_the_cache_is_not_downloaded(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(AlignflowError, match="not in the local Hugging Face cache and validate does not download"):
        count_parameters("nobody-here/NoSuchModel-7B")


def ds_table(fn, *args) -> dict[str, float]:
    """DeepSpeed's printed table: options -> the per-GPU GB figure it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        fn(*args)
    rows = re.findall(r"^\s*[\d.]+GB \|\s*([\d.]+)GB \| (.+)$", out.getvalue(), re.M)
    return {options.replace(" ", "").replace("OffloadDeviceEnum.", ""): float(gpu) for gpu, options in rows}


def spec_of(text: str):
    return parse_spec(yaml.safe_load(text), "m.yaml")


SPEC = """
name: m
stages:
  train:
    kind: sft
    inputs: {{model: {model}, dataset: d.jsonl}}
    algorithm: sft
    settings: {{dtype: bf16, zero_stage: {zero}, offload_optimizer: {opt}, offload_params: {params}}}
"""


@pytest.mark.parametrize("zero,opt,params", [(2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"),
                                             (3, "cpu", "none"), (3, "cpu", "cpu")])
def test_the_printed_figure_is_deepspeeds_estimator(qwen05, zero, opt, params):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import (estimate_zero2_model_states_mem_needs,
                                                      estimate_zero2_model_states_mem_needs_all_cold)
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs

    spec = spec_of(SPEC.format(model=qwen05, zero=zero, opt=opt, params=params))
    resolved = resolved_stages(spec, get_plugins())["train"]
    memory = stage_memory(spec, "train", resolved, Path("."), gpus_per_node=4, nodes=2)
    if zero == 2:
        _, gpu = estimate_zero2_model_states_mem_needs(QWEN05_PARAMS, 4, 2, cpu_offload=opt == "cpu")
        table = ds_table(estimate_zero2_model_states_mem_needs_all_cold, QWEN05_PARAMS, 4, 2)
        printed = table[f"offload_optimizer={'cpu' if opt == 'cpu' else 'none'}"]
    else:
        _, gpu, _ = estimate_zero3_model_states_mem_needs(QWEN05_PARAMS, QWEN05_LARGEST, 4, 2, cpu_offload=opt == "cpu",
                                                          cpu_offload_params=params == "cpu", zero_init=False)
        table = ds_table(estimate_zero3_model_states_mem_needs_all_cold, QWEN05_PARAMS, QWEN05_LARGEST, 4, 2)
        printed = table[f"offload_param={params},offload_optimizer={opt},zero_init=0"]
    assert memory.states_gpu == gpu and memory.frozen_gpu == 0
    assert f"{printed:.2f} GiB model states" in memory.line()  # the figure DeepSpeed's own table prints
    # ZeRO-2 without offload by hand: 2 bytes of 16-bit weights + 18/8 of the states partitioned over 8 GPUs
    if (zero, opt) == (2, "none"):
        assert gpu == 2 * QWEN05_PARAMS + 18 * QWEN05_PARAMS // 8


def test_zero0_is_one_gpus_worth_and_frozen_models_are_added(qwen05):
    spec = spec_of(f"""
name: m
stages:
  dpo:
    kind: preference
    inputs: {{model: {qwen05}, dataset: d.jsonl}}
    algorithm: dpo
    settings: {{dtype: bf16}}
""")
    memory = stage_memory(spec, "dpo", resolved_stages(spec, get_plugins())["dpo"], Path("."), gpus_per_node=8)
    assert memory.states_gpu == 20 * QWEN05_PARAMS  # ZeRO-0 partitions nothing: 2 + 18 bytes a parameter
    assert memory.frozen == {"reference": Counts(QWEN05_PARAMS, QWEN05_LARGEST)}
    assert memory.frozen_gpu == 2 * QWEN05_PARAMS  # the bf16 reference, whole on every GPU
    assert memory.gpu == 22 * QWEN05_PARAMS and gib(memory.gpu) == "10.12 GiB"


def test_a_lora_policy_trains_its_adapters_over_frozen_base_weights(qwen05):
    spec = spec_of(f"""
name: m
stages:
  grpo:
    kind: rl
    inputs: {{model: {qwen05}, dataset: d.jsonl}}
    algorithm: grpo
    rewards: [math_accuracy]
    sampler: {{name: vllm, config: {{gpu_memory_utilization: 0.3}}}}
    settings: {{dtype: bf16, zero_stage: 2, lora: {{r: 8}}}}
""")
    memory = stage_memory(spec, "grpo", resolved_stages(spec, get_plugins())["grpo"], Path("."))
    assert memory.trained == {"LoRA adapters": Counts(4_399_104, 8 * 4864)}
    assert memory.frozen == {"base weights": Counts(QWEN05_PARAMS, QWEN05_LARGEST)}  # the reference is the base
    assert memory.states_gpu == 20 * 4_399_104 and memory.frozen_gpu == 2 * QWEN05_PARAMS
    assert memory.sampler_share == 0.3


def test_an_unreachable_model_is_not_estimated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    spec = spec_of(SPEC.format(model="nobody-here/NoSuchModel-7B", zero=2, opt="none", params="none"))
    line = stage_memory(spec, "train", resolved_stages(spec, get_plugins())["train"], Path(".")).line()
    assert line.startswith("train: not estimated: nobody-here/NoSuchModel-7B: its config is not in the local")


def test_sizes():
    assert parse_size("80GiB") == parse_size("80GB") == parse_size("81920MiB") == 80 * 2**30
    with pytest.raises(AlignflowError, match="expected a size such as 80GiB"):
        parse_size("eighty")
