"""Per-token math on logits, in fp32: the log-prob of the chosen token and the entropy, without the full
log-softmax of a [B, T, V] tensor."""

import torch
from torch import Tensor


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[tokens] without materialising the full log-softmax; fp32 result."""
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    # Half precision: upcast one sequence at a time rather than the whole [B, T, V] tensor.
    return torch.stack([
        row.float().log_softmax(-1).gather(-1, tok.unsqueeze(-1)).squeeze(-1)
        for row, tok in zip(logits, tokens)
    ])


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last axis, in fp32, one sequence at a time."""
    out = []
    for row in logits:
        row = row.float()
        probs = row.softmax(-1)
        out.append(torch.logsumexp(row, -1) - (probs * row).sum(-1))
    return torch.stack(out)
