"""The `sft` stage: prompt-masked NLL on prompt/completion or chat rows, through the training engine."""

from __future__ import annotations

import math

import torch

from alignflow.core.aggregation import StepNorm
from alignflow.core.data import collate, load_rows, tokenize
from alignflow.core.engine import Engine
from alignflow.core.models import load_model, load_tokenizer, token_logprobs
from alignflow.core.preference import TokenBatch
from alignflow.core.progress import progress
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.evaluation import evaluate_model
from alignflow.flows.stages.training import (micro_slices, model_source, plugin, save_pretrained, step_rows,
                                             total_steps)


def token_batch(engine, batch: dict) -> TokenBatch:
    """Log-probs of a collated micro-batch under the policy; the mask is its completion tokens."""
    ids = batch["input_ids"].to(engine.device)
    mask = (batch["labels"] != -100).to(engine.device)
    logps = token_logprobs(engine.model, ids, batch["attention_mask"].to(engine.device), mask)
    return TokenBatch(logps, mask.float())


@torch.no_grad()
def held_out_loss(engine, algo, rows, micro: int, pad_id: int) -> float:
    """The algorithm's loss over held-out rows, as one step (each row weighted as in training)."""
    engine.model.eval()
    batches = [collate([rows[i] for i in idx], pad_id) for idx in micro_slices(list(range(len(rows))), micro)]
    norm = StepNorm.of([(b["labels"] != -100).float() for b in batches])  # every rank scores every row
    total = sum(algo.loss(token_batch(engine, b), norm)[0].item() for b in batches)
    engine.model.train()
    return total


def train_loop(ctx: StageContext, engine, algo, train, pad_id: int, bar) -> None:
    """The optimizer steps left: seeded batches, step-normalised micro-batch losses, checkpoints."""
    s = ctx.settings
    for step in engine.steps():
        local = step_rows(step, len(train), s.batch_size, ctx.seed)[engine.rank::engine.world_size]
        batches = [collate(train.select(idx).to_list(), pad_id) for idx in micro_slices(local, s.micro_batch_size)]
        norm = engine.step_norm([(b["labels"] != -100).float() for b in batches])
        loss = 0.0
        for batch in batches:
            micro_loss, _ = algo.loss(token_batch(engine, batch), norm)
            engine.backward(micro_loss)
            loss += micro_loss.item()
        metrics = {"loss": loss, **engine.step()}
        bar.update(tokens=int(norm.num_tokens), **metrics)
        if engine.step_count % s.log_every == 0 or engine.step_count == engine.total_steps:
            ctx.log_metrics(metrics, engine.step_count)
        engine.maybe_save({"step": engine.step_count, "loss": loss})


def run_sft(ctx: StageContext) -> StageResult:
    """Train, report the held-out loss (and eval_dataset accuracy with rewards), save the model."""
    s = ctx.settings
    algo = plugin(ctx, ctx.spec.algorithm, ctx.plugins.algorithms, "algorithm")
    with model_source(ctx) as src:
        tokenizer = load_tokenizer(src)
        model = load_model(src, dtype=s.dtype)
    rows, stats = tokenize(load_rows(ctx.inputs["dataset"], "sft"), tokenizer, s.max_length, "sft")
    split = rows.train_test_split(test_size=s.eval_fraction, seed=ctx.seed) if s.eval_fraction else None
    train, held_out = (split["train"], split["test"]) if split else (rows, None)
    ctx.log_metrics({f"data/{k}": float(v) for k, v in stats.items()}, 0)

    steps = total_steps(len(train), s)
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, s, steps, ctx.checkpoint_dir.parent)
    pad_id = tokenizer.pad_token_id
    with progress(ctx.name, total=steps, initial=engine.step_count) as bar:
        train_loop(ctx, engine, algo, train, pad_id, bar)
    # a run resumed after its last step trained nothing now: its loss is in the checkpoint
    last_loss = bar.metrics.get("loss", (engine.data_state or {}).get("loss", math.nan))
    final = {"train/loss": float(last_loss), "steps": float(steps)}
    if held_out is not None:
        final["eval/loss"] = held_out_loss(engine, algo, held_out.to_list(), s.micro_batch_size, pad_id)
    out = save_pretrained(engine, tokenizer, ctx.work_dir / "model")
    final.update(evaluate_model(ctx, engine.module, tokenizer))
    ctx.log_metrics(final, engine.step_count)
    headline = "eval/accuracy" if "eval/accuracy" in final else "train/loss"
    return StageResult(outputs={"model": out}, metrics=final, headline=headline)
