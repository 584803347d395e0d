"""Small `Rollout`s for the RL algorithm tests: rewards per sample, groups, a response mask, old/ref log-probs."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from alignflow.core.rl.algorithm import Rollout


def lengths_mask(lengths: Sequence[int], width: int | None = None) -> torch.Tensor:
    """A right-padded response mask [B, width] with `lengths[i]` ones in row i."""
    width = width or max(lengths)
    return torch.tensor([[1] * n + [0] * (width - n) for n in lengths])


def make_rollout(rewards: Sequence[float] = (1.0, 0.0, 0.0, 1.0), *, group=None, mask=None, old: float = -1.0,
                 ref: float | None = None, max_new_tokens: int | None = None, dtype=torch.float32,
                 **fields) -> Rollout:
    """One group (unless `group`) of len(rewards) samples, old log-probs `old` and ref log-probs `ref` everywhere.

    `mask` defaults to all ones over 4 positions; `max_new_tokens` to the mask's width; `fields` go to `Rollout`.
    """
    n = len(rewards)
    mask = torch.ones(n, 4, dtype=torch.long) if mask is None else mask
    group = torch.zeros(n, dtype=torch.long) if group is None else torch.as_tensor(group)
    logprobs = {"old_logprobs": torch.full(mask.shape, old, dtype=dtype)}
    if ref is not None:
        logprobs["ref_logprobs"] = torch.full(mask.shape, ref, dtype=dtype)
    return Rollout(rewards=torch.as_tensor(rewards, dtype=torch.float32), group=group, response_mask=mask,
                   max_new_tokens=mask.shape[1] if max_new_tokens is None else max_new_tokens,
                   **{**logprobs, **fields})
