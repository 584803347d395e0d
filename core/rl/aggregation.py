"""Loss aggregation: one function, named modes, normalised by the whole optimizer step.

Each micro-batch's loss is divided by the token or sequence count of the *whole optimizer step*
(every micro-batch on every rank), so that summing micro-batch losses gives exactly the loss of one
big batch. Dividing by the micro-batch's own count instead (the accumulation bug shipped by several
RL libraries) over-weights tokens of short micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
MODES: tuple[str, ...] = AggMode.__args__


@dataclass(frozen=True)
class StepNorm:
    """Normalisers of one optimizer step, counted over all its micro-batches and all ranks."""

    num_tokens: float  # valid (mask = 1) tokens
    num_seqs: float  # sequences
    constant: float | None = None  # seq-mean-token-sum-norm: e.g. Dr. GRPO's generation budget

    @classmethod
    def of(cls, masks: list[torch.Tensor], constant: float | None = None) -> "StepNorm":
        """The norm of a step made of these micro-batch masks (on one rank)."""
        return cls(float(sum(m.sum().item() for m in masks)), float(sum(m.shape[0] for m in masks)), constant)


def aggregate(loss_mat: torch.Tensor, mask: torch.Tensor, mode: str, norm: StepNorm | None = None) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to this micro-batch's share of the step loss.

    With `norm=None` the micro-batch is the whole step.
    """
    mask = mask.to(loss_mat.dtype)
    if norm is None:
        norm = StepNorm(float(mask.sum().item()), float(mask.shape[0]))
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1.0)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(-1) / mask.sum(-1).clamp(min=1.0)
        return per_seq.sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(norm.num_seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        if norm.constant is None:
            raise ValueError("seq-mean-token-sum-norm needs StepNorm.constant (e.g. the generation budget)")
        return masked.sum() / (max(norm.num_seqs, 1.0) * norm.constant)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {', '.join(MODES)}")
