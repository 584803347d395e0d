"""The `sft` stage: prompt-masked NLL on prompt/completion or chat rows, through the shared offline loop."""

from __future__ import annotations

import torch

from alignflow.core.train.batching import collate
from alignflow.core.train.engine import Engine
from alignflow.core.train.models import token_logprobs
from alignflow.core.train.offline import TokenBatch
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.evaluation import evaluate_model
from alignflow.flows.stages.offline_loop import Feed, final_metrics, held_out_metrics, split_rows, train_loop
from alignflow.flows.stages.training import (load_policy, load_tokenizer_for, model_source,
                                             save_pretrained, total_steps)


def token_feed(engine, pad_id: int) -> Feed:
    """Rows -> TokenBatch: the policy's log-probs of each label; a token mean divides by completion tokens."""

    def batch(micro: dict) -> TokenBatch:
        mask = (micro["labels"] != -100).to(engine.device)
        logps = token_logprobs(engine.model, micro["input_ids"].to(engine.device),
                               micro["attention_mask"].to(engine.device), mask)
        return TokenBatch(logps, mask.float())

    return Feed(lambda rows: collate(rows, pad_id), batch, lambda micro: (micro["labels"] != -100).float())


def run_sft(ctx: StageContext) -> StageResult:
    """Train, report the held-out loss (and eval_dataset accuracy with rewards), save the model."""
    s = ctx.settings
    algo = ctx.resolved.algorithm.build()
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_policy(ctx, src)
    train, held_out = split_rows(ctx, tokenizer, "sft")

    steps = total_steps(len(train), s)
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, s, steps, ctx.checkpoint_dir.parent, auto_precision=ctx.options.auto_precision)
    feed = token_feed(engine, tokenizer.pad_token_id)
    last = train_loop(ctx, engine, algo, train, feed)
    final = final_metrics(last, held_out_metrics(engine, algo, held_out, feed, s.micro_batch_size), steps)
    out = save_pretrained(engine, tokenizer, ctx.work_dir / "model")
    final.update(evaluate_model(ctx, engine.module, tokenizer))
    ctx.log_metrics(final, engine.step_count)
    headline = "eval/accuracy" if "eval/accuracy" in final else "train/loss"
    return StageResult(outputs={"model": out}, metrics=final, headline=headline, fingerprint=engine.fingerprint())
