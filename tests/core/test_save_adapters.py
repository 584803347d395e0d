"""The helpers the `vllm` sampler's adapter sync stands on: a peft policy's base weights under the base's own
names, and its adapters saved alone as a folder that loads back as the base plus them."""

import json

import pytest
import torch
from safetensors.torch import load_file

from alignflow.core.train.adapters import base_state_dict, is_adapter_dir, merged_state_dict, save_adapters, with_lora
from alignflow.core.train.models import load_model, token_logprobs
from alignflow.core.spec.settings import LoraSettings


@pytest.fixture(scope="module")
def base_dir(tiny_model):
    return tiny_model()


def moved(base_dir):
    """LoRA r 4 on every linear layer with both A and B moved off their init."""
    model = with_lora(load_model(base_dir), LoraSettings(r=4), str(base_dir))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.add_(0.2 * torch.randn(p.shape, generator=g))
    return model


def test_base_state_dict_is_the_base_model_untouched(base_dir):
    model, base = moved(base_dir), load_model(base_dir).state_dict()
    got = base_state_dict(model)
    assert got.keys() == base.keys()  # q_proj.weight, not q_proj.base_layer.weight; no lora_A / lora_B
    assert all(torch.equal(got[k], base[k]) for k in base)
    merged, q = merged_state_dict(model), "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(merged[q], base[q])
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"])  # not adapted: the base's


def test_saved_adapters_are_only_a_and_b_and_load_back_as_the_policy(base_dir, tmp_path):
    model = moved(base_dir)
    folder = save_adapters(model, tmp_path / "a")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert is_adapter_dir(folder) and json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    saved = load_file(folder / "adapter_model.safetensors")
    # r (in + out) per adapted layer, r = 4: q 4(128+128) = 1024, k, v 4(128+64) = 768, o 1024,
    # gate, up, down 4(128+512) = 2560: 11264 per layer, 45056 over the 4 layers, in 2 tensors per module
    assert len(saved) == 2 * 7 * 4 and sum(t.numel() for t in saved.values()) == 45056
    assert all(".lora_A.weight" in k or ".lora_B.weight" in k for k in saved)
    ids = torch.tensor([[5, 9, 14, 20, 7, 3]]) + 3
    mask = torch.ones_like(ids)
    with torch.no_grad():
        torch.testing.assert_close(token_logprobs(load_model(folder), ids, mask), token_logprobs(model, ids, mask),
                                   rtol=0, atol=1e-5)
