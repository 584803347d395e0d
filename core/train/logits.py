"""Per-token math on logits, in fp32: the log-prob of the chosen token and the entropy, without the full
log-softmax of a [B, T, V] tensor."""

import torch
from torch import Tensor

UPCAST_ELEMENTS = 1 << 24  # half-precision logits are upcast this many at a time (64 MB of fp32)


def pieces(logits: Tensor) -> int:
    """Leading-axis rows per fp32 upcast: as many as fit in UPCAST_ELEMENTS (at least one). Upcasting row by
    row instead costs one op per row: thousands a micro-batch for packed [tokens, V] logits."""
    per_row = max(1, logits[0].numel()) if len(logits) else 1
    return max(1, UPCAST_ELEMENTS // per_row)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[tokens] without materialising the full log-softmax; fp32 result."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # Half precision: upcast a bounded block of rows at a time rather than the whole tensor.
    step = pieces(logits)
    return torch.cat([logprobs_from_logits(rows.float(), tok) for rows, tok in
                      zip(logits.split(step), tokens.split(step))])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last axis, in fp32, a bounded block of rows at a time."""
    out = []
    for rows in logits.split(pieces(logits)):
        rows = rows.float()
        out.append(torch.logsumexp(rows, -1) - (rows.softmax(-1) * rows).sum(-1))
    return torch.cat(out)
