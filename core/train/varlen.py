"""The packed trainer forward without padding: every token-wise op on the real tokens only.

A packed micro-batch (core/train/packing.py) lays its tokens out in [R, W] rows for attention, and at the
lengths RL produces on a CPU only ~70% of those slots hold a token (sequences of 24-41 tokens in rows of
64: two rarely fit one row, and the row count is padded to a multiple of CPU_ROWS). transformers' forward
runs every projection, norm and MLP over all R*W slots. Here the model's own modules run on the N real tokens
as one [N, H] tensor, and only attention sees the rows: q, k and v are scattered into them
(`index_copy`), attended with the layout's mask, and the output gathered back (`index_select`). N is padded to
a multiple of TOKEN_MULTIPLE with tokens that attend to nothing and are attended by nothing: oneDNN builds and
keeps kernels per matrix shape (the tiny model's stage peaked 60-120 MB higher with tokens padded to 64 or
128 and the head run on the picked rows only, a count free to take any value; 682 MB as here, 711 without). The
arithmetic is transformers' (the same weights, norms, rotary tables and attention function; q, k and v in one
matmul), so the log-probs equal its forward of the packed rows up to float rounding (tested), and so do the
gradients. In the `rl` stage on one core the tiny model's update took 7.5% less time, the 8M model's 4-8% less.

Llama-family decoders only (Llama, Mistral, Qwen2, Qwen3), as core/train/decoder.py rebuilds; `unsupported` says
why anything else (or a model in gradient checkpointing, with attention dropout, adapters or partitioned
ZeRO-3 weights) keeps transformers' forward.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor

from alignflow.core.train.decoder import unsupported as decoder_unsupported

ATTENTION = ("sdpa", "eager")
TOKEN_MULTIPLE = 256  # token counts are padded to a multiple of this: oneDNN builds kernels per matrix shape


def unsupported(model) -> str | None:
    """Why `model` (a transformers causal LM, or an engine wrapping one) keeps transformers' forward (None: it
    need not)."""
    model = getattr(model, "module", model)
    why = decoder_unsupported(model)
    if why is not None:
        return why
    config = model.config
    if next(model.parameters()).device.type != "cpu":
        return "measured on a CPU only"
    if getattr(model, "is_gradient_checkpointing", False):
        return "gradient checkpointing"
    if getattr(config, "attention_dropout", 0.0):
        return "attention dropout"
    if getattr(config, "_attn_implementation", "sdpa") not in ATTENTION:
        return f"attn_implementation {config._attn_implementation!r}"
    return None


def rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def attend(attn, h: Tensor, cos: Tensor, sin: Tensor, target: Tensor, rows: int, width: int, bias: Tensor):
    """One attention block on real tokens h [N, H]: one q/k/v projection and one rotary per token, attention over
    the packed [rows, width] slots (`target`: each token's slot), the output projection per token."""
    N, D, n = h.shape[0], attn.head_dim, len(target)
    heads, kv = attn.config.num_attention_heads, attn.config.num_key_value_heads
    qk, v = F.linear(h, *qkv_weights(attn)).view(N, -1, D)[:n].split([heads + kv, kv], 1)
    if getattr(attn, "q_norm", None) is not None:  # Qwen3's per-head norms, before the rotary embedding
        qk = torch.cat([attn.q_norm(qk[:, :heads]), attn.k_norm(qk[:, heads:])], 1)
    qk = qk * cos[:n] + rotate_half(qk) * sin[:n]  # q and k heads in one go (cos, sin [N, 1, D])
    # One scatter for the three, in q's dtype: q and k leave the rotary in fp32 under autocast, as transformers
    # hands them to attention (whose grouped-query sum of k's gradient then runs in fp32 too)
    slots = qk.new_zeros(rows * width, heads + 2 * kv, D).index_copy(0, target, torch.cat([qk, v.to(qk.dtype)], 1))
    q, k, v = slots.view(rows, width, -1, D).transpose(1, 2).split([heads, kv, kv], 1)
    interface = attention_interface(attn)
    out, _ = interface(attn, q, k, v, bias, dropout=0.0, scaling=attn.scaling)  # [rows, width, heads, D]
    out = out.reshape(rows * width, heads * D).index_select(0, target)
    return attn.o_proj(F.pad(out, (0, 0, 0, N - n)))  # the padding tokens' attention output: 0


def qkv_weights(attn) -> tuple[Tensor, Tensor | None]:
    """The q, k and v projections' weights (and biases) as one: a matmul for the three (their gradients flow
    back through the `cat`). The tiny model's update took ~4% less time than with three projections and two
    rotaries, the 8M model's ~10% (`rl` stage, 1 core, alternating processes)."""
    parts = (attn.q_proj, attn.k_proj, attn.v_proj)
    weight = torch.cat([p.weight for p in parts])
    if all(p.bias is None for p in parts):  # Llama, Mistral: no zeros built every forward
        return weight, None
    return weight, torch.cat([p.weight.new_zeros(len(p.weight)) if p.bias is None else p.bias for p in parts])


def attention_interface(attn):
    """The attention function transformers' forward of this model calls (sdpa or eager)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    eager = sys.modules[type(attn).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS.get_interface(attn.config._attn_implementation, eager)


def hidden_states(model, ids: Tensor, positions: Tensor, target: Tensor, rows: int, width: int,
                  bias: Tensor) -> Tensor:
    """The last layer's hidden states [N, H] (before the final norm) of the real tokens `ids` [N] at
    `positions` [N], which sit at flat slots `target` [N] (ascending) of the packed rows; `bias` [rows, 1,
    width, width]: the additive attention mask."""
    base = getattr(model, "module", model).model
    pad = -len(ids) % TOKEN_MULTIPLE  # padding tokens, attended by none and attending to none
    x = base.embed_tokens(F.pad(ids, (0, pad)))
    positions = F.pad(positions, (0, pad))
    cos, sin = (t[0, :, None] for t in base.rotary_emb(x[None], positions[None]))  # [N, 1, D]: over heads
    for layer in base.layers:
        x = x + attend(layer.self_attn, layer.input_layernorm(x), cos, sin, target, rows, width, bias)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


def logits_at(model, hidden: Tensor, rows: Tensor) -> Tensor:
    """The vocabulary logits at `rows` of `hidden` [N, H]. The final norm and head run on all N tokens and the
    rows are picked after: N is a multiple of TOKEN_MULTIPLE, the count of `rows` is free (a kernel each)."""
    inner = getattr(model, "module", model)
    return inner.lm_head(inner.model.norm(hidden)).index_select(0, rows)
