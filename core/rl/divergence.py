"""Divergences between a teacher's and a student's next-token distributions, from their logits.

P = teacher, Q = student, both softmax(logits) over the last dimension (the vocabulary, or the teacher's top-k):

    forward KL   KL(P || Q) = sum_v P(v) (log P(v) - log Q(v))                          mode covering
    reverse KL   KL(Q || P) = sum_v Q(v) (log Q(v) - log P(v))                          mode seeking
    JSD(beta)    beta KL(P || M) + (1 - beta) KL(Q || M),   M = beta P + (1 - beta) Q    (GKD, arXiv 2306.13649)

JSD(beta) / beta -> KL(P || Q) as beta -> 0 and JSD(beta) / (1 - beta) -> KL(Q || P) as beta -> 1, while JSD(beta)
itself goes to 0 at both ends. TRL's `generalized_jsd_loss` computes the same JSD(beta) strictly inside (0, 1)
but switches to the un-scaled KL at beta = 0 (forward) and beta = 1 (reverse), so its loss jumps by about 1 / beta
at the ends: here those are the separate `forward_kl` and `reverse_kl` divergences, and JSD needs 0 < beta < 1.
The student receives a gradient through Q both in M and in KL(Q || M), as in TRL.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

Divergence = Literal["forward_kl", "reverse_kl", "jsd"]


def _kl(log_p: Tensor, log_q: Tensor) -> Tensor:
    """sum_v p (log p - log q) over the last dimension; 0 where p = 0 (a -inf logit, a masked token)."""
    p = log_p.exp()
    return torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p)).sum(-1)


TopKTail = Literal["renormalize", "drop", "bucket"]
# verl's defaults for its top-k forward KL, which `drop` follows: each log-prob floored (`log_prob_min_clamp`),
# then the per-position partial sum floored at 0 and clamped to +-10 (`loss_max_clamp`); zero gradient past each
DROP_LOG_PROB_FLOOR = -10.0
DROP_LOSS_CLAMP = 10.0


def top_k_log_probs(student_logits: Tensor, teacher_logits: Tensor, k: int,
                    tail: TopKTail = "renormalize") -> tuple[Tensor, Tensor]:
    """The student's and teacher's log-probs on the teacher's k most likely tokens at each position.

    `tail` says what becomes of the other tokens' mass:
    renormalize (default): both distributions are renormalised over the k tokens (a softmax of the k logits), so
      each is a distribution; the student's mass outside the k tokens then has no gradient at all: it is not
      pushed into them, only shaped inside them.
    drop: the full-vocabulary log-probs of the k tokens, their tail mass ignored, each floored at -10
      (DROP_LOG_PROB_FLOOR), as verl's `compute_forward_kl_topk`; the forward KL is then verl's
      sum_{v in top-k} P(v) (log P(v) - log Q(v)), which does raise the student's mass on the k tokens, and
      `logit_divergence` floors it at 0 and clamps it at 10 as verl (the sum is negative where the student puts
      more mass on the k tokens than the teacher). (The reverse KL and JSD of such partial sums are not
      divergences: use them with `renormalize` or `bucket`.)
    bucket: k + 1 outcomes, the k tokens and one for all the others (each side's tail mass), both still
      distributions, so the student's tail mass is penalised too.
    """
    index = teacher_logits.topk(k, dim=-1).indices
    if tail == "renormalize":
        return student_logits.gather(-1, index).log_softmax(-1), teacher_logits.gather(-1, index).log_softmax(-1)
    s, t = student_logits.log_softmax(-1).gather(-1, index), teacher_logits.log_softmax(-1).gather(-1, index)
    if tail == "drop":  # below e^-10 a student's log-prob is held (no gradient) and a teacher's raised to e^-10
        return s.clamp(min=DROP_LOG_PROB_FLOOR), t.clamp(min=DROP_LOG_PROB_FLOOR)
    return _with_tail(s), _with_tail(t)


def _with_tail(log_p: Tensor) -> Tensor:
    """[..., k] log-probs and log(1 - their mass) as a last outcome: [..., k + 1]."""
    mass = log_p.logsumexp(-1, keepdim=True).clamp(max=0.0)
    return torch.cat([log_p, torch.log(-torch.expm1(mass))], dim=-1)


def divergence(student_log_probs: Tensor, teacher_log_probs: Tensor, kind: Divergence, beta: float = 0.5) -> Tensor:
    """The per-position divergence [...] of the student from the teacher, summed over the last dimension."""
    s, t = student_log_probs, teacher_log_probs
    if kind == "forward_kl":
        return _kl(t, s)
    if kind == "reverse_kl":
        return _kl(s, t)
    if not 0.0 < beta < 1.0:
        raise ValueError(f"jsd needs 0 < beta < 1, got {beta}: use forward_kl (beta -> 0) or reverse_kl (beta -> 1)")
    log_m = torch.logsumexp(torch.stack([t + math.log(beta), s + math.log(1.0 - beta)]), dim=0)
    return beta * _kl(t, log_m) + (1.0 - beta) * _kl(s, log_m)


def logit_divergence(student_logits: Tensor, teacher_logits: Tensor, kind: Divergence, beta: float = 0.5,
                     top_k: int | None = None, tail: TopKTail = "renormalize", chunk: int = 256) -> Tensor:
    """[b, T] divergence at each position from [b, T, V] logits (float32 at least), over `chunk` positions at a
    time so the softmax intermediates are of one chunk; `top_k` restricts both to the teacher's k likeliest
    tokens (`top_k_log_probs`; with `drop` the partial sum is then floored at 0 and clamped at 10, as verl). A
    logits width past the shared vocabulary (a padded embedding) is cut off."""
    width = min(student_logits.shape[-1], teacher_logits.shape[-1])
    out = []
    for lo in range(0, student_logits.shape[1], chunk):
        s = student_logits[:, lo:lo + chunk, :width]
        t = teacher_logits[:, lo:lo + chunk, :width].to(s.device)
        dtype = torch.promote_types(s.dtype, torch.float32)
        s, t = s.to(dtype), t.to(dtype)
        partial = top_k is not None and top_k < width
        if partial:
            s, t = top_k_log_probs(s, t, top_k, tail)
        else:
            s, t = s.log_softmax(-1), t.log_softmax(-1)
        d = divergence(s, t, kind, beta)
        # a partial sum (`drop`) can be negative: verl floors it at 0, so a student nearer the teacher than 0
        # is not pushed further; with log-probs floored at -10 it is under 10 (1 + k e^-10) before the clamp
        out.append(d.clamp(0.0, DROP_LOSS_CLAMP) if partial and tail == "drop" else d)
    return torch.cat(out, dim=1)
