"""Decoding on a model's own forward and a transformers `DynamicCache`, behind the packed decoder's interface.

The packed decoder (`alignflow.core.train.decoder`) rebuilds Llama-family models only; this runs every model transformers
runs (and the policy on a GPU), so the `hf` sampler's loop and its episode caches (`alignflow.core.episode_cache`)
serve both. `start` prefills left-padded prompts, `step` appends one token per running row, `keep` drops the rows
that stopped, `resume` prefills only the tokens after each prompt's known prefix, `row` copies one row's cache out.
"""

from __future__ import annotations

import inspect

import torch
from torch import Tensor


class ForwardDecoder:
    """One decode loop's state on `model`'s forward: its cache, the attention mask over it, the next positions."""

    def __init__(self, model):
        self.model = model
        self.argument = cache_argument(model)

    @staticmethod
    def keeps_rows(model) -> bool:
        """Whether a row's cache can be copied out whole: every layer caches every token (no sliding window)."""
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer

        return all(type(layer) is DynamicLayer for layer in DynamicCache(config=model.config).layers)

    def start(self, ids: Tensor, mask: Tensor, n: int = 1, width: int | None = None) -> Tensor:
        """Prefill left-padded prompts `ids`/`mask` [B, T0] (each row its own: `n` must be 1; `width` is unused:
        the cache grows). Returns the next-token logits [B, vocab]."""
        from transformers import DynamicCache

        if n != 1:
            raise ValueError("ForwardDecoder.start: rows are not shared; repeat each prompt n times instead")
        self.cache = DynamicCache(config=self.model.config)
        self.mask = mask
        return self.forward(ids, (mask.cumsum(-1) - 1).clamp(min=0))

    def resume(self, ids: Tensor, mask: Tensor, past: list, width: int | None = None) -> Tensor:
        """Prefill left-padded prompts `ids`/`mask` [P, T0] whose first tokens' keys and values are known (`past[p]`:
        an `episode_cache.Kept` or None): the cache holds those, right-aligned in C columns, and only each prompt's
        new tokens, right-aligned in the S columns after them, are computed (the columns between are masked)."""
        from transformers import DynamicCache

        P, T0 = ids.shape
        known = torch.tensor([0 if p is None else len(p) for p in past], device=mask.device)
        new = mask.sum(-1) - known
        C, S = int(known.max()), int(new.max())
        col = torch.arange(max(C, S), device=mask.device)
        known_mask = (col[:C] >= C - known[:, None]).long()  # [P, C]
        new_mask = (col[:S] >= S - new[:, None]).long()  # [P, S]
        self.cache = DynamicCache(config=self.model.config)
        some = next(p for p in past if p is not None)
        for i in range(len(some.keys)):
            keys, values = (self.known(past, part, i, C) for part in ("keys", "values"))
            self.cache.update(keys, values, i)
        self.mask = torch.cat([known_mask, new_mask], 1)
        return self.forward(ids[:, T0 - S:], (self.mask.cumsum(-1) - 1).clamp(min=0)[:, C:])

    @staticmethod
    def known(past: list, part: str, layer: int, width: int) -> Tensor:
        """Layer `layer`'s known keys or values (`part`) of every row, right-aligned in [P, kv_heads, width, D];
        zeros before them (masked)."""
        some = next(getattr(p, part)[layer] for p in past if p is not None)
        out = some.new_zeros(len(past), some.shape[0], width, some.shape[-1])
        for r, p in enumerate(past):
            if p is not None:
                out[r, :, width - len(p):] = getattr(p, part)[layer]
        return out

    def forward(self, ids: Tensor, positions: Tensor) -> Tensor:
        """The last column's logits of `ids` [B, t] at `positions` [B, t], appended to the cache."""
        out = self.model(input_ids=ids, attention_mask=self.mask, position_ids=positions, use_cache=True,
                         logits_to_keep=1, **{self.argument: self.cache}).logits[:, -1]
        self.positions = positions[:, -1:] + 1
        return out

    def step(self, token: Tensor) -> Tensor:
        """Append one token per running row; the logits of the token after it [B, vocab]."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(len(token), 1)], 1)
        return self.forward(token[:, None], self.positions)

    def keep(self, rows: Tensor) -> None:
        """Keep only batch rows `rows` (the others stopped)."""
        self.cache.batch_select_indices(rows)
        self.mask, self.positions = self.mask[rows], self.positions[rows]

    def row(self, b: int, first: int = 0) -> tuple[list[Tensor], list[Tensor]]:
        """Batch row `b`'s keys and values over its tokens (the columns its mask holds), per layer, copied out
        [kv_heads, tokens, D]. `first` is unused: the mask says where the row's tokens are."""
        cols = self.mask[b].nonzero().flatten()
        return ([layer.keys[b][:, cols] for layer in self.cache.layers],
                [layer.values[b][:, cols] for layer in self.cache.layers])


def cache_argument(model) -> str:
    """The forward's name for the KV cache: `cache` in newer transformers, `past_key_values` before (a peft
    model's forward passes its keywords on to the model it wraps: that one's name)."""
    model = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
