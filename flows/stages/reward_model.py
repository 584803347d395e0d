"""The `reward_model` stage: a scalar-head model trained on pairwise rows (Bradley-Terry and kin).

The model scores exactly the text the `reward_model` reward scores at inference, prompt + completion
without an EOS appended, at its last token; it is saved as an ordinary one-label
`AutoModelForSequenceClassification` checkpoint, which that reward and PPO load.
"""

from __future__ import annotations

import torch

from alignflow.core.train.batching import collate
from alignflow.core.train.offline import RewardBatch
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.offline_loop import Feed, train_value_model

SIDES = ("chosen", "rejected")


def without_eos(rows: list[dict], eos_id: int | None) -> list[dict]:
    """Drop the EOS tokenisation appends to each completion: the reward scores text that has none."""
    out = []
    for row in rows:
        row = dict(row)
        for side in SIDES:
            ids = row[f"{side}_input_ids"]
            if eos_id is not None and len(ids) > 1 and ids[-1] == eos_id:
                row[f"{side}_input_ids"], row[f"{side}_labels"] = ids[:-1], row[f"{side}_labels"][:-1]
        out.append(row)
    return out


def reward_feed(engine, pad_id: int, eos_id: int | None) -> Feed:
    """Pairs -> RewardBatch: chosen and rejected scored by the value model, with the optional margin."""

    def score(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        ids, mask = ids.to(engine.device), mask.to(engine.device)
        return engine.model(ids, mask, last_only=True)

    def batch(micro: dict) -> RewardBatch:
        chosen, rejected = (score(micro[f"{side}_input_ids"], micro[f"{side}_attention_mask"]) for side in SIDES)
        margin = micro["margin"].to(engine.device, chosen.dtype) if "margin" in micro else None
        return RewardBatch(chosen, rejected, margin)

    return Feed(lambda rows: collate(without_eos(rows, eos_id), pad_id), batch,
                lambda micro: micro["chosen_attention_mask"])


def run_reward_model(ctx: StageContext) -> StageResult:
    """Train the value head and body on pairs, report held-out pairwise accuracy, save the checkpoint."""
    return train_value_model(ctx, "pairwise", lambda engine, tokenizer: reward_feed(
        engine, tokenizer.pad_token_id, tokenizer.eos_token_id))
