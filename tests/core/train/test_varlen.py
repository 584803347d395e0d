"""The packed forward on real tokens only (core/train/varlen.py) against transformers' forward of the same packed
rows: the same log-probs, entropies and gradients on every architecture it runs, in fp32 and under bf16 autocast
with the eager attention the `rl` stage uses there."""

import types

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

from alignflow.core.train import packing, varlen
from alignflow.core.train.models import token_logprobs

SMALL = dict(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
MODELS = {"qwen2": (Qwen2ForCausalLM, Qwen2Config, {}), "llama": (LlamaForCausalLM, LlamaConfig, {}),
          "qwen3": (Qwen3ForCausalLM, Qwen3Config, {"head_dim": 16})}  # head_dim != hidden / heads


def build(kind: str, attention: str = "sdpa", **extra):
    cls, config, kw = MODELS[kind]
    torch.manual_seed(0)
    return cls(config(**SMALL, **kw, **extra, attn_implementation=attention)).train()


def group_batch(prompts: int = 3, n: int = 4):
    """GRPO-shaped rows: `prompts` prompts of 3-6 tokens, `n` completions each of 1-12 tokens, left-padded;
    labels on the completions."""
    g = torch.Generator().manual_seed(1)
    rows, labels = [], []
    for _ in range(prompts):
        prompt = torch.randint(3, 50, (int(torch.randint(3, 7, (1,), generator=g)),), generator=g).tolist()
        for _ in range(n):
            completion = torch.randint(3, 50, (int(torch.randint(1, 13, (1,), generator=g)),), generator=g).tolist()
            rows.append(prompt + completion)
            labels.append([0] * len(prompt) + [1] * len(completion))
    T = max(map(len, rows))
    ids = torch.tensor([[0] * (T - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (T - len(r)) + [1] * len(r) for r in rows])
    return ids, attention, torch.tensor([[0] * (T - len(l)) + l for l in labels])


def run(model, batch, real_tokens_only: bool, autocast: bool, monkeypatch):
    """(log-probs, entropies, gradients) of the packed forward, on real tokens only or on the padded rows."""
    ids, attention, labels = batch
    calls = []
    with monkeypatch.context() as m:
        if real_tokens_only:
            real = varlen.hidden_states
            m.setattr(varlen, "hidden_states", lambda *a: calls.append(1) or real(*a))
        else:
            m.setattr(varlen, "unsupported", lambda model: "the padded rows, for comparison")
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            lp, ent = token_logprobs(model, ids, attention, labels, temperature=0.7, return_entropy=True,
                                     packed=True)
        weights = torch.randn(lp.shape, generator=torch.Generator().manual_seed(2))  # tokens weigh differently
        ((lp * weights).sum() + ent.sum()).backward()
    assert bool(calls) == real_tokens_only
    return lp.detach(), ent.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp(min=1e-12))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_real_tokens_only_equal_the_padded_rows_in_fp32(kind, monkeypatch):
    model = build(kind)
    assert varlen.unsupported(model) is None
    batch = group_batch()
    (lp, ent, grads), (vlp, vent, vgrads) = (run(model, batch, on, False, monkeypatch) for on in (False, True))
    assert ((lp != 0) == batch[2].bool()).all()
    torch.testing.assert_close(vlp, lp, atol=1e-5, rtol=0)
    torch.testing.assert_close(vent, ent, atol=1e-5, rtol=0)
    for name, g in grads.items():
        torch.testing.assert_close(vgrads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_real_tokens_only_equal_the_padded_rows_under_bf16_autocast(kind, monkeypatch):
    """bf16-mixed as the `rl` stage runs it on a CPU (eager attention): log-probs to bf16's rounding, and gradients
    as close to the fp32 ones as transformers' own bf16 forward's are. Both round their weight gradients to bf16
    (~0.4% an element), and one matmul for q, k and v sums in another order than three, so they differ from each
    other by that much (0.5-0.6% on the worst weight); each is 0.8-1.5% from fp32 on these models (AVX-512 EPYC).
    A wrong rotary, mask or scatter is off by far more."""
    model = build(kind, "eager")
    batch = group_batch()
    (lp, ent, grads), (vlp, vent, vgrads) = (run(model, batch, on, True, monkeypatch) for on in (False, True))
    torch.testing.assert_close(vlp, lp, atol=2e-2, rtol=0)
    torch.testing.assert_close(vent, ent, atol=2e-2, rtol=0)
    _, _, exact = run(model, batch, False, False, monkeypatch)  # fp32, no autocast
    worst = {name: max(relative(g[n], exact[n]) for n in exact if exact[n].norm() > 1e-6)
             for name, g in (("transformers", grads), ("real tokens only", vgrads))}
    assert worst["real tokens only"] <= 1.2 * worst["transformers"] + 1e-4, worst


def test_matmuls_take_a_multiple_of_token_multiple_and_attention_a_multiple_of_cpu_rows(monkeypatch):
    """oneDNN keeps kernels per matrix shape: the token count is padded (free, it grew a stage's memory), and the
    attention rows come in CPU_ROWS as transformers' packed forward takes them."""
    model = build("qwen2")
    tokens, grids = [], []
    model.model.embed_tokens.register_forward_hook(lambda module, args, out: tokens.append(out.shape[0]))
    real = varlen.attention_interface

    def recording(attn):
        inner = real(attn)
        return lambda module, q, *a, **k: grids.append(q.shape) or inner(module, q, *a, **k)

    monkeypatch.setattr(varlen, "attention_interface", recording)
    ids, attention, labels = group_batch()
    with torch.no_grad():
        token_logprobs(model, ids, attention, labels, packed=True)
    assert tokens[0] % varlen.TOKEN_MULTIPLE == 0 and 0 < tokens[0] < int(attention.sum()) + varlen.TOKEN_MULTIPLE
    rows, heads, width, _ = grids[0]
    assert rows % packing.CPU_ROWS == 0 and heads == SMALL["num_attention_heads"] and width == packing.pack_width(model)


def test_what_it_does_not_run_keeps_transformers_forward_with_the_reason():
    model = build("qwen2")
    assert varlen.unsupported(types.SimpleNamespace(module=model)) is None  # the stage passes DeepSpeed's engine
    model.gradient_checkpointing_enable()
    assert varlen.unsupported(model) == "gradient checkpointing"
    assert varlen.unsupported(build("qwen2", attention_dropout=0.1)) == "attention dropout"
    assert "rope_type" in varlen.unsupported(build("llama", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 10000.0}))
