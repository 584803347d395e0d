"""A decode-only rebuild of Llama-family models (Llama, Mistral, Qwen2, Qwen3) for fast sampling.

At the shapes RL decodes on a CPU (a few hundred rows, one new token each, hidden sizes in the
hundreds) a step of transformers' forward spends more time in per-op overhead (mask building, a
cache that grows by `torch.cat`, three projections where one would do) than in its matmuls. This
module keeps the same arithmetic with fewer, larger ops:

- the q/k/v projections fused into one matmul, and gate/up into one;
- a preallocated KV cache per layer, written in place (no growing tensors), rows dropped by index;
- rotary tables computed once per call; attention of the one new token as two batched matmuls over
  the cache's filled width, grouped-query heads without repeating the cache;
- each prompt prefilled once and its cache shared by its `n` samples;
- a multi-turn episode's next turn prefilled from the keys and values its last turn left (`resume`), computing
  only its new tokens (`alignflow.core.episode_cache`);
- weights in the decode dtype (fp32, or bf16 where the trainer computes in bf16: the copy is
  taken at every `pack`, so it always holds the trainer's current weights).

The logits equal transformers' up to float rounding (tests check both paths on every supported
architecture). Anything else (adapters, sliding windows, scaled rotary embeddings, partitioned
ZeRO-3 weights) is refused by `unsupported`, and the caller uses transformers' forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def unsupported(model) -> str | None:
    """Why `model` cannot be packed (None if it can)."""
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind not in ARCHITECTURES:
        return f"model_type {kind!r} is not one of {ARCHITECTURES}"
    if hasattr(model, "get_base_model") or hasattr(model, "peft_config"):
        return "adapters (peft) are applied on the fly"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) \
            and kind != "llama":
        return "sliding-window attention"
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return f"rope_type {rope.get('rope_type')!r} (only the default rotary embedding is rebuilt)"
    if getattr(config, "mlp_bias", False):
        return "biases in the MLP"
    if any(p.numel() == 0 for p in model.parameters()):
        return "partitioned (ZeRO-3) weights"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r}"
    return None


def rope_theta(config) -> float:
    rope = getattr(config, "rope_parameters", None) or {}
    return float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class Layer:
    """One decoder layer's weights, fused, in the decode dtype."""

    def __init__(self, layer, dtype: torch.dtype):
        a, m = layer.self_attn, layer.mlp
        cast = lambda t: None if t is None else t.detach().to(dtype).contiguous()  # noqa: E731
        bias = [p.bias for p in (a.q_proj, a.k_proj, a.v_proj)]
        self.qkv = cast(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).T)
        self.qkv_bias = None if bias[0] is None else cast(torch.cat(bias))
        self.o = cast(a.o_proj.weight.T)
        self.o_bias = cast(a.o_proj.bias)
        self.gate_up = cast(torch.cat([m.gate_proj.weight, m.up_proj.weight]).T)
        self.down = cast(m.down_proj.weight.T)
        self.norm1 = layer.input_layernorm.weight.detach().float()
        self.norm2 = layer.post_attention_layernorm.weight.detach().float()
        norms = [getattr(a, name, None) for name in ("q_norm", "k_norm")]  # Qwen3's per-head norms
        self.q_norm, self.k_norm = (None, None) if norms[0] is None else [n.weight.detach().float() for n in norms]


class PackedDecoder:
    """Prefill and one-token steps of a Llama-family model on a preallocated KV cache.

    `start(prompts, n, width)` prefills each prompt once and gives every one of its `n` rows the
    prompt's cache, or `resume(prompts, past, width)` only the tokens after each one's known prefix;
    `step(tokens)` appends one token per running row and returns next-token logits; `keep(rows)` drops the
    rows that stopped; `row(b, first)` copies a row's cache out.
    """

    def __init__(self, model, dtype: torch.dtype = torch.float32):
        c = model.config
        self.dtype, self.eps = dtype, c.rms_norm_eps
        self.heads, self.kv_heads = c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        base = model.model
        self.embed = base.embed_tokens.weight.detach().to(dtype)
        self.layers = [Layer(layer, dtype) for layer in base.layers]
        self.norm = base.norm.weight.detach().float()
        self.lm_head = model.lm_head.weight.detach().to(dtype).T.contiguous()
        self.lm_bias = None if model.lm_head.bias is None else model.lm_head.bias.detach().to(dtype)
        half = torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim
        self.inv_freq = 1.0 / rope_theta(c) ** half
        self.sign = torch.cat([-torch.ones(len(half)), torch.ones(len(half))])
        self.device = self.embed.device

    def rms(self, x: Tensor, weight: Tensor) -> Tensor:
        """RMSNorm in fp32, as transformers computes it, back in the decode dtype."""
        return F.rms_norm(x.float(), weight.shape, weight, self.eps).to(self.dtype)

    def rotary(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """cos and signed sin [..., 1, head_dim] for `positions` [...] (broadcast over heads): the first half of
        sin negated, so `rotate` swaps the halves with one `roll` (rotate_half(x) * sin = roll(x) * signed sin)."""
        angles = positions.float()[..., None] * self.inv_freq
        angles = torch.cat([angles, angles], -1)[..., None, :]
        return angles.cos().to(self.dtype), (angles.sin() * self.sign).to(self.dtype)

    @staticmethod
    def rotate(x: Tensor, cos: Tensor, signed_sin: Tensor) -> Tensor:
        return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin

    def project(self, layer: Layer, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Token rows x [M, H] -> qk [M, heads + kv_heads, D] (q heads, then k heads, both rotated), v [M, kv_heads,
        D]. Every helper takes token rows, two-dimensional: a one-token step of B rows is [B, H] throughout (170 ops a
        step of the tiny model against 213 with [B, 1, H] and its views: 0.07-0.09 ms less at 16-128 rows)."""
        y = self.rms(x, layer.norm1)
        qkv = y @ layer.qkv if layer.qkv_bias is None else torch.addmm(layer.qkv_bias, y, layer.qkv)
        h = self.heads
        qk, v = qkv.view(len(x), -1, self.head_dim).split([h + self.kv_heads, self.kv_heads], 1)
        if layer.q_norm is not None:
            qk = torch.cat([self.rms(qk[:, :h], layer.q_norm), self.rms(qk[:, h:], layer.k_norm)], 1)
        return self.rotate(qk, cos, sin), v  # q and k heads in one go

    def out(self, layer: Layer, x: Tensor, attn: Tensor) -> Tensor:
        """x + attn @ o, then the MLP's residual block: the rest of the layer, on token rows [M, H]."""
        x = torch.addmm(x, attn, layer.o) if layer.o_bias is None else x + (attn @ layer.o + layer.o_bias)
        gate, up = (self.rms(x, layer.norm2) @ layer.gate_up).chunk(2, -1)
        return torch.addmm(x, F.silu(gate) * up, layer.down)  # the residuals inside the matmuls

    def logits(self, x: Tensor) -> Tensor:
        h = self.rms(x, self.norm) @ self.lm_head
        return (h if self.lm_bias is None else h + self.lm_bias).float()

    @torch.no_grad()
    def start(self, ids: Tensor, mask: Tensor, n: int, width: int) -> Tensor:
        """Prefill left-padded prompts `ids`/`mask` [P, T0]; rows p*n..p*n+n-1 share prompt p's cache, which
        has room for `width` tokens in all. Returns the next-token logits [P*n, vocab]."""
        P, T0 = ids.shape
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self.rotary(positions)
        # padding bias over the cache: pads of the prompt are never attended; later slots are filled in order
        self.bias = torch.zeros(P, width, device=self.device)
        self.bias[:, :T0].masked_fill_(mask == 0, float("-inf"))
        causal = torch.ones(T0, T0, dtype=torch.bool, device=self.device).tril()
        allowed = causal & (mask[:, None, :] == 1)
        allowed |= torch.eye(T0, dtype=torch.bool, device=self.device)  # a pad row attends to itself: no NaN
        x = F.embedding(ids.flatten(), self.embed)  # token rows [P * T0, H]
        cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)
        heads = lambda t: t.view(P, T0, -1, self.head_dim).transpose(1, 2).float()  # noqa: E731 [P, heads, T0, D]
        self.k, self.v = [], []
        for layer in self.layers:
            qk, v = self.project(layer, x, cos, sin)
            k, v = heads(qk[:, self.heads:]), heads(v)
            attn = F.scaled_dot_product_attention(heads(qk[:, : self.heads]), k, v, attn_mask=allowed[:, None],
                                                  enable_gqa=True)
            x = self.out(layer, x, attn.transpose(1, 2).reshape(P * T0, -1).to(self.dtype))
            self.k.append(self.cache(k, n, width))
            self.v.append(self.cache(v, n, width))
        self.bias = self.bias.repeat_interleave(n, 0)
        self.positions = positions[:, -1].repeat_interleave(n, 0) + 1
        self.filled = T0
        return self.logits(x.view(P, T0, -1)[:, -1]).repeat_interleave(n, 0)

    @torch.no_grad()
    def resume(self, ids: Tensor, mask: Tensor, past: list, width: int) -> Tensor:
        """Prefill left-padded prompts `ids`/`mask` [P, T0] (one row each) of which the first tokens' keys and
        values are known: `past[p]` (an `episode_cache.Kept`, or None) holds prompt p's first len(past[p]) tokens'.
        Only the tokens after them are computed, attending to those and to each other; the cache has room for
        `width` tokens in all. Returns the next-token logits [P, vocab]."""
        P, T0 = ids.shape
        lengths = mask.sum(-1)
        new = lengths - torch.tensor([0 if p is None else len(p) for p in past], device=self.device)
        S = int(new.max())  # the last S columns are computed: the longest new part
        col = torch.arange(T0, device=self.device)
        computed = col[T0 - S:]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cos, sin = self.rotary(positions[:, T0 - S:])
        self.bias = torch.zeros(P, width, device=self.device)
        self.bias[:, :T0].masked_fill_(mask == 0, float("-inf"))
        # a computed column sees the prompt's tokens up to itself (a pad column only itself: no NaN)
        allowed = (col <= computed[:, None]) & (mask[:, None, :] == 1) | (col == computed[:, None])
        fresh = computed >= T0 - new[:, None]  # [P, S]: a column of the new part (else a known token or a pad)
        first = (T0 - lengths).tolist()  # each row's first real column
        x = F.embedding(ids[:, T0 - S:].flatten(), self.embed)  # token rows [P * S, H]
        cos, sin = cos.flatten(0, 1), sin.flatten(0, 1)
        heads = lambda t: t.view(P, S, -1, self.head_dim).transpose(1, 2).float()  # noqa: E731 [P, heads, S, D]
        self.k, self.v = [], []
        for i, layer in enumerate(self.layers):
            qk, v = self.project(layer, x, cos, sin)
            keys = joined([None if p is None else p.keys[i] for p in past], first, heads(qk[:, self.heads:]),
                          fresh, T0, width)
            values = joined([None if p is None else p.values[i] for p in past], first, heads(v), fresh, T0, width)
            attn = F.scaled_dot_product_attention(heads(qk[:, : self.heads]), keys[:, :, :T0], values[:, :, :T0],
                                                  attn_mask=allowed[:, None], enable_gqa=True)
            x = self.out(layer, x, attn.transpose(1, 2).reshape(P * S, -1).to(self.dtype))
            self.k.append(keys)
            self.v.append(values)
        self.positions = positions[:, -1] + 1
        self.filled = T0
        return self.logits(x.view(P, S, -1)[:, -1])

    def row(self, b: int, first: int) -> tuple[list[Tensor], list[Tensor]]:
        """Batch row `b`'s keys and values from column `first` to the last filled one, per layer, copied out
        [kv_heads, filled - first, D]."""
        return ([k[b, :, first: self.filled].clone() for k in self.k],
                [v[b, :, first: self.filled].clone() for v in self.v])

    @staticmethod
    def cache(prompt: Tensor, n: int, width: int) -> Tensor:
        """A [P * n, kv_heads, width, D] cache whose first T0 slots hold prompt p's [P, kv_heads, T0, D] in rows
        p*n..p*n+n-1. The slots after them are left unwritten (a step reads only the filled ones): writing only
        the prompts' slots, not repeating whole zeroed caches, took the tiny model's prefill from 2.6 to 2.2 ms."""
        P, kv, T0, D = prompt.shape
        out = prompt.new_empty(P * n, kv, width, D)
        out.view(P, n, kv, width, D)[:, :, :, :T0] = prompt[:, None]
        return out

    @torch.no_grad()
    def step(self, tokens: Tensor) -> Tensor:
        """Append one token per running row; the logits of the token after it [B, vocab]."""
        t, D, h, kv = self.filled, self.head_dim, self.heads, self.kv_heads
        B, g = len(tokens), h // kv
        cos, sin = self.rotary(self.positions)  # [B, 1, D]: over the heads
        x = F.embedding(tokens, self.embed)
        bias = self.bias[:, None, None, : t + 1].expand(B, kv, 1, t + 1).reshape(B * kv, 1, t + 1)  # every layer's
        for i, layer in enumerate(self.layers):
            qk, v = self.project(layer, x, cos, sin)
            self.k[i][:, :, t] = qk[:, h:]
            self.v[i][:, :, t] = v
            keys, values = self.k[i][:, :, : t + 1].flatten(0, 1), self.v[i][:, :, : t + 1].flatten(0, 1)
            q = qk[:, :h].reshape(B * kv, g, D).float()  # the g query heads that share each kv head, [B * kv, g, D]
            scores = torch.baddbmm(bias, q, keys.transpose(-1, -2), alpha=D ** -0.5)  # scaled, masked: one op
            x = self.out(layer, x, torch.bmm(scores.softmax(-1), values).view(B, h * D).to(self.dtype))
        self.positions = self.positions + 1
        self.filled = t + 1
        return self.logits(x)

    def keep(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (the others stopped)."""
        self.k = [k.index_select(0, rows) for k in self.k]
        self.v = [v.index_select(0, rows) for v in self.v]
        self.bias, self.positions = self.bias.index_select(0, rows), self.positions.index_select(0, rows)


def joined(past: list, first: list[int], computed: Tensor, fresh: Tensor, end: int, width: int) -> Tensor:
    """A [P, kv_heads, width, D] cache of prompts ending at column `end`: row p's known tokens `past[p]`
    [kv_heads, L, D] (or None) from its first real column `first[p]`, the `computed` [P, kv_heads, S, D] in the
    S columns before `end` where `fresh` [P, S], zeros on the pads before (masked, but a NaN left there would poison
    the scores). The columns from `end` on are left for the decode steps to fill."""
    P, kv, S, D = computed.shape
    out = computed.new_empty(P, kv, width, D)
    out[:, :, :end].zero_()
    for p, known in enumerate(past):
        if known is not None:
            out[p, :, first[p]: first[p] + known.shape[1]] = known
    last = out[:, :, end - S: end]
    last.copy_(torch.where(fresh[:, None, :, None], computed, last))
    return out
