"""The micro-step of an algorithm that learns from the teacher's whole next-token distribution
(`TeacherDistributions`): both models' logits on the micro-batch's response positions, the teacher's under
no_grad, so at most one micro-batch's [b, T, V] teacher logits exist at a time, never the rollout's."""

from __future__ import annotations

from dataclasses import fields, replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor

from alignflow.core.rl.algorithm import PolicyBatch, sampler_corrected
from alignflow.core.train.logits import entropy_from_logits, logprobs_from_logits
from alignflow.core.train.models import position_ids

if TYPE_CHECKING:
    from alignflow.flows.stages.rl.stage import Parts
    from alignflow.flows.stages.rl.update import Targets


def response_logits(model, ids: Tensor, attention: Tensor, start: int, temperature: float) -> Tensor:
    """[b, T - start, V] logits at positions start.. (column j predicts token start + j), over `temperature`."""
    logits = model(ids, attention_mask=attention, position_ids=position_ids(attention),
                   logits_to_keep=ids.shape[1] - start + 1, use_cache=False).logits[:, :-1]
    return logits / temperature if temperature != 1.0 else logits


def first_response_column(mask: Tensor) -> int:
    cols = mask.any(0).nonzero()
    return max(int(cols[0]), 1) if len(cols) else mask.shape[1] - 1


def columns(batch: PolicyBatch, start: int, stop: int) -> PolicyBatch:
    """The batch's [b, T] tensors cut to columns start:stop."""
    cut = {f.name: getattr(batch, f.name)[:, start:stop] for f in fields(batch)
           if isinstance(getattr(batch, f.name), Tensor) and getattr(batch, f.name).dim() == 2}
    return replace(batch, **cut)


def distribution_step(p: "Parts", t: "Targets", rows: Tensor, cut: tuple[Tensor, Tensor, Tensor],
                      policy_weights: Tensor | None = None):
    """(per-token loss, metrics, the batch view it is aligned with, [b, T] entropy) of micro-batch `rows` (`cut`:
    its ids, attention and response mask); `policy_weights` ([b, T], the rows' sampler correction) reach the
    loss in the view."""
    (ids, attention, mask), algo, temperature = cut, p.algo, p.knobs.temperature
    start, width = first_response_column(mask), ids.shape[1]
    student = response_logits(p.engine.model, ids, attention, start, temperature)
    with torch.no_grad():
        teacher_logits = response_logits(p.teacher, ids, attention, start, temperature)
    logprobs = F.pad(logprobs_from_logits(student, ids[:, start:]), (start, 0)) * mask
    wide = F.pad(logprobs, (0, t.batch.rollout.response_mask.shape[1] - width))
    view = columns(t.batch.rollout.minibatch(rows, logprobs=wide, advantages=t.advantages, returns=t.returns,
                                             policy_weights=policy_weights), start, width)
    per_token, metrics = sampler_corrected(algo, view, lambda b: algo.distribution_loss(b, student, teacher_logits))
    with torch.no_grad():
        entropy = F.pad(entropy_from_logits(student.detach()), (start, 0)) * mask
    return per_token, metrics, view, entropy
