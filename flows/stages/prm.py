"""The `prm` stage: a process reward model, one score per reasoning step, trained on step labels.

Rows are `steps` rows (prompt, steps, step_labels), as the `step_labels` stage writes them. The text
is the prompt, then each step followed by `step_separator`; step i's score is the value head at
its last token (the separator). The model is saved as a one-label `AutoModelForSequenceClassification`
checkpoint with `step_separator` in its config, which the `prm` reward reads to score the same text.
"""

from __future__ import annotations

import torch

from alignflow.core.train.batching import collate
from alignflow.core.train.datasets import IGNORE_INDEX
from alignflow.core.train.offline import StepBatch
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.offline_loop import Feed, train_value_model


def step_major(values: torch.Tensor, labels: torch.Tensor) -> StepBatch:
    """[B, T] token values and labels (IGNORE_INDEX off step ends) -> [B, S] step scores and labels."""
    at_step = labels != IGNORE_INDEX
    counts = at_step.sum(-1)
    width = max(int(counts.max()), 1)
    T = labels.shape[1]
    # Step-end positions in order, then T (past the end) for padding; the first `width` columns.
    positions = torch.where(at_step, torch.arange(T, device=labels.device), T).sort(-1).values[:, :width]
    mask = torch.arange(width, device=labels.device) < counts[:, None]
    index = positions.clamp(max=T - 1)
    return StepBatch(values.gather(1, index), torch.where(mask, labels.gather(1, index), 0.0), mask)


def step_feed(engine, pad_id: int) -> Feed:
    """Step rows -> StepBatch: the value head on every token, read at each step's end."""

    def batch(micro: dict) -> StepBatch:
        ids, mask = micro["input_ids"].to(engine.device), micro["attention_mask"].to(engine.device)
        values = engine.model(ids, mask)
        return step_major(values, micro["labels"].to(engine.device, values.dtype))

    def labelled(micro: dict) -> torch.Tensor:
        return micro["labels"] != IGNORE_INDEX

    return Feed(lambda rows: collate(rows, pad_id), batch, labelled, lambda micro: float(labelled(micro).sum()))


def run_prm(ctx: StageContext) -> StageResult:
    """Train the value head and body on step labels, report held-out step accuracy, save the checkpoint."""
    return train_value_model(ctx, "steps", lambda engine, tokenizer: step_feed(engine, tokenizer.pad_token_id),
                             step_separator=ctx.settings.step_separator)
