"""The packed decoder against transformers' own forward: same logits on every architecture it rebuilds,
with left padding, a prompt's cache shared by its samples, and rows dropped mid-way."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from alignflow.core.train.decoder import PackedDecoder, unsupported
from alignflow.core.sampling import left_pad

SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
MODELS = {"qwen2": (Qwen2ForCausalLM, Qwen2Config, {}), "llama": (LlamaForCausalLM, LlamaConfig, {}),
          "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16})}  # head_dim != hidden / heads


def build(kind: str, **extra):
    cls, config, kw = MODELS[kind]
    torch.manual_seed(0)
    return cls(config(**SMALL, **kw, **extra)).eval()


def reference(model, rows: list[list[int]]) -> torch.Tensor:
    """Next-token logits of each row alone, unpadded, by transformers' forward."""
    with torch.no_grad():
        return torch.stack([model(torch.tensor([r])).logits[0, -1] for r in rows])


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_logits_equal_transformers_with_padding_shared_prefill_and_dropped_rows(kind):
    model = build(kind)
    assert unsupported(model) is None
    prompts, n = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]], 2
    ids, mask = left_pad(prompts, 0)
    decoder = PackedDecoder(model)
    rows = [p for p in prompts for _ in range(n)]
    logits = decoder.start(ids, mask, n, ids.shape[1] + 4)
    torch.testing.assert_close(logits, reference(model, rows), atol=1e-5, rtol=0)
    for t in range(3):
        tokens = torch.arange(len(rows)) + 11 + t
        rows = [r + [int(tok)] for r, tok in zip(rows, tokens)]
        logits = decoder.step(tokens)
        torch.testing.assert_close(logits, reference(model, rows), atol=1e-5, rtol=0)
        if t == 0:  # rows 1 and 4 stop: the others go on unchanged
            keep = torch.tensor([0, 2, 3, 5])
            decoder.keep(keep)
            rows = [rows[i] for i in keep]


def test_bf16_decode_stays_near_fp32():
    model = build("qwen2")
    ids, mask = left_pad([[1, 2, 3], [4, 5]], 0)
    fp32 = PackedDecoder(model).start(ids, mask, 1, 8)
    bf16 = PackedDecoder(model, torch.bfloat16).start(ids, mask, 1, 8)
    assert bf16.dtype == torch.float32  # logits always leave in fp32, for sampling and log-probs
    assert 0 < (bf16 - fp32).abs().max() < 0.05


def test_what_it_does_not_rebuild_is_refused_with_the_reason():
    assert "rope_type" in unsupported(build("llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0}))
    assert "MLP" in unsupported(build("llama", mlp_bias=True))
    assert "sliding" in unsupported(build("qwen2", use_sliding_window=True, sliding_window=16))
    assert "model_type" in unsupported(torch.nn.Linear(2, 2))
