"""The `reward_model` stage: a scalar-head model trained on pairwise rows (Bradley-Terry and kin).

The model scores exactly the text the `reward_model` reward scores at inference, prompt + completion
without an EOS appended, at its last token; it is saved as an ordinary one-label
`AutoModelForSequenceClassification` checkpoint, which that reward and PPO load.
"""

from __future__ import annotations

import torch

from alignflow.core.train.batching import collate
from alignflow.core.train.datasets import load_rows
from alignflow.core.train.engine import Engine
from alignflow.core.train.offline import RewardBatch
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.offline_loop import Feed, final_metrics, held_out_metrics, split_rows, train_loop
from alignflow.flows.stages.training import (load_model_for, load_tokenizer_for, model_source, save_pretrained,
                                             total_steps)

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
    s = ctx.settings
    algo = ctx.resolved.algorithm.build()
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_model_for(ctx, src, value_head=True)
    held_out = load_rows(ctx.inputs["eval_dataset"], "pairwise") if "eval_dataset" in ctx.inputs else None
    train, held_out = split_rows(ctx, tokenizer, "pairwise", held_out)

    steps = total_steps(len(train), s)
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, s, steps, ctx.checkpoint_dir.parent, auto_precision=ctx.options.auto_precision)
    feed = reward_feed(engine, tokenizer.pad_token_id, tokenizer.eos_token_id)
    last = train_loop(ctx, engine, algo, train, feed)
    held = held_out_metrics(engine, algo, held_out, feed, s.micro_batch_size)
    final = final_metrics(last, held, steps)
    out = save_pretrained(engine, tokenizer, ctx.work_dir / "model")
    ctx.log_metrics(final, engine.step_count)
    headline = "eval/accuracy" if "eval/accuracy" in final else "train/accuracy"
    return StageResult(outputs={"model": out}, metrics=final, headline=headline, fingerprint=engine.fingerprint())
