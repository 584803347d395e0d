"""What the offline stages (sft, preference, reward_model, prm) share: rows, the step loop, held-out metrics.

A stage describes how its rows become the algorithm's batch with a `Feed`; the loop below never
looks inside the batch, so every algorithm of the stage runs through the same code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.datasets import load_rows, tokenize
from alignflow.core.errors import DataError
from alignflow.core.train.offline import Mean
from alignflow.core.progress import progress
from alignflow.core.train.dist import gathered
from alignflow.core.train.engine import Engine
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.training import (load_model_for, load_tokenizer_for, micro_slices, model_source,
                                             save_pretrained, step_rows, total_steps)


@dataclass
class Feed:
    """How a stage turns dataset rows into what `algorithm.loss` takes, one micro-batch at a time."""

    collate: Callable[[list[dict]], dict]  # tokenised rows -> a padded micro-batch
    batch: Callable[[dict], Any]  # micro-batch -> the algorithm's batch (forwards here, in engine.autocast())
    norm_mask: Callable[[dict], torch.Tensor]  # [B, T]: B examples, and the tokens a token mean divides by
    # how much a micro-batch's mean metrics weigh in the step's: its examples, unless the metrics are
    # means over something else (a PRM's over labelled steps)
    weight: Callable[[dict], float] = lambda micro: len(micro["row"])


class Tally:
    """Example-weighted means of micro-batch metrics; NaN (a metric with no example) is skipped.

    A micro-batch's metric weighs its examples (`weight`), or its own count when it is a `Mean`.
    """

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.weights: dict[str, float] = {}

    def add(self, metrics: dict[str, torch.Tensor | Mean], weight: float) -> None:
        for key, value in metrics.items():
            value, count = (value.value, value.count) if isinstance(value, Mean) else (value, weight)
            value, count = float(value), float(count)
            if not math.isnan(value) and count > 0:
                self.sums[key] = self.sums.get(key, 0.0) + count * value
                self.weights[key] = self.weights.get(key, 0.0) + count

    def means(self) -> dict[str, float]:
        return {k: self.sums[k] / self.weights[k] for k in self.sums}

    def over_ranks(self, loss: float) -> tuple[dict[str, float], float]:
        """(the means over every rank's examples, `loss` summed over ranks: each holds its share)."""
        parts = gathered((self.sums, self.weights, loss))
        if len(parts) == 1:
            return self.means(), loss
        total = Tally()
        for sums, weights, _ in parts:
            for key in sums:
                total.sums[key] = total.sums.get(key, 0.0) + sums[key]
                total.weights[key] = total.weights.get(key, 0.0) + weights[key]
        return total.means(), sum(part[2] for part in parts)


def eval_rows(ctx: StageContext, schema: str):
    """`eval_dataset` rows when it holds `schema` rows; None when absent or in another schema."""
    if "eval_dataset" not in ctx.inputs:
        return None
    try:
        return load_rows(ctx.inputs["eval_dataset"], schema)
    except DataError:
        return None  # e.g. prompt+answer rows, which evaluate_model scores instead


def split_rows(ctx: StageContext, tokenizer, schema: str, held_out=None, **tokenize_options):
    """(train, held_out or None), tokenised: `held_out` rows (from `eval_rows`) when given, else a fraction.

    Each row gets its index in its own split as `row`, so per-row caches (reference log-probs) line up.
    """
    s = ctx.settings
    rows, stats = tokenize(load_rows(ctx.inputs["dataset"], schema), tokenizer, s.max_length, schema,
                           source=str(ctx.inputs["dataset"]), **tokenize_options)
    ctx.log_metrics({f"data/{k}": float(v) for k, v in stats.items()}, 0)
    if held_out is not None:
        where = str(ctx.inputs.get("eval_dataset", "held-out rows"))
        held_out, _ = tokenize(held_out, tokenizer, s.max_length, schema, source=where, **tokenize_options)
    elif s.eval_fraction:
        split = rows.train_test_split(test_size=s.eval_fraction, seed=ctx.seed)
        rows, held_out = split["train"], split["test"]
    return _indexed(rows), _indexed(held_out) if held_out is not None else None


def _indexed(rows):
    return rows.add_column("row", list(range(len(rows))))


def micro_batches(rows, indices: list[int], micro: int, collate: Callable[[list[dict]], dict]) -> list[dict]:
    return [collate(rows.select(idx).to_list()) for idx in micro_slices(indices, micro)]


def train_loop(ctx: StageContext, engine, algo, train, feed: Feed) -> dict[str, float]:
    """The optimizer steps left; returns the last step's metrics (from the checkpoint when none are left)."""
    s = ctx.settings
    last = dict((engine.data_state or {}).get("metrics", {}))
    with progress(ctx.name, total=engine.total_steps, initial=engine.step_count) as bar:
        for step in engine.steps():
            local = step_rows(step, len(train), s.batch_size, ctx.seed)[engine.rank::engine.world_size]
            micros = micro_batches(train, local, s.micro_batch_size, feed.collate)
            norm = engine.step_norm([feed.norm_mask(m) for m in micros])
            loss, tally = 0.0, Tally()
            for micro in micros:
                with engine.autocast():
                    scored = feed.batch(micro)
                micro_loss, metrics = algo.loss(scored, norm)
                engine.backward(micro_loss)
                loss += micro_loss.item()  # step shares: their sum is the step's loss
                tally.add(metrics, feed.weight(micro))
            means, loss = tally.over_ranks(loss)
            last = {**algo.summarize(means), "loss": loss, **engine.step()}
            bar.update(**last)
            if engine.step_count % s.log_every == 0 or engine.step_count == engine.total_steps:
                ctx.log_metrics(last, engine.step_count)
            engine.maybe_save({"step": engine.step_count, "metrics": last})
    return last


@torch.no_grad()
def held_out_metrics(engine, algo, rows, feed: Feed, micro: int) -> dict[str, float]:
    """The algorithm's loss and metrics over held-out rows, taken as one step; {} without rows.

    The ranks share the micro-batches and all get the metrics over every row, except where each must
    run every one: under ZeRO-3 (a forward pass is a collective) and for a loss that all-reduces itself.
    """
    if rows is None:
        return {}
    engine.model.eval()
    share = engine.settings.zero_stage != 3 and not algo.loss_reduces_over_ranks
    slices = micro_slices(list(range(len(rows))), micro)
    if share:
        slices = slices[engine.rank::engine.world_size]
    micros = [feed.collate(rows.select(idx).to_list()) for idx in slices]
    masks = [feed.norm_mask(m) for m in micros]
    norm = engine.step_norm(masks) if share else StepNorm.of(masks)
    loss, tally = 0.0, Tally()
    for m in micros:
        with engine.autocast():
            scored = feed.batch(m)
        micro_loss, metrics = algo.loss(scored, norm)
        loss += micro_loss.item()
        tally.add(metrics, feed.weight(m))
    engine.model.train()
    means, loss = tally.over_ranks(loss) if share else (tally.means(), loss)
    return {**algo.summarize(means), "loss": loss}


def final_metrics(train: dict[str, float], held_out: dict[str, float], steps: int) -> dict[str, float]:
    """train/… from the last step (less its lr and grad norm), eval/… from the held-out rows."""
    out = {f"train/{k}": v for k, v in train.items() if k not in ("lr", "grad_norm")}
    out.update({f"eval/{k}": v for k, v in held_out.items()})
    return {**out, "steps": float(steps)}


def train_value_model(ctx: StageContext, schema: str, make_feed: Callable[[Engine, Any], Feed],
                      **tokenize_options) -> StageResult:
    """Train the value head and body on `schema` rows through `make_feed(engine, tokenizer)`, report held-out
    accuracy, save the checkpoint: the `reward_model` and `prm` stages. `tokenize_options` (the `prm` stage's
    step_separator) are also written into the saved model's config, for the reward that scores the same text."""
    s = ctx.settings
    algo = ctx.resolved.algorithm.build()
    with model_source(ctx) as src:
        tokenizer = load_tokenizer_for(ctx, src)
        model = load_model_for(ctx, src, value_head=True)
    held_out = load_rows(ctx.inputs["eval_dataset"], schema) if "eval_dataset" in ctx.inputs else None
    train, held_out = split_rows(ctx, tokenizer, schema, held_out, **tokenize_options)

    steps = total_steps(len(train), s)
    torch.manual_seed(ctx.seed)
    engine = Engine.create(model, s, steps, ctx.checkpoint_dir.parent, auto_precision=ctx.options.auto_precision)
    feed = make_feed(engine, tokenizer)
    last = train_loop(ctx, engine, algo, train, feed)
    final = final_metrics(last, held_out_metrics(engine, algo, held_out, feed, s.micro_batch_size), steps)
    for key, value in tokenize_options.items():
        setattr(engine.module.config, key, value)
    out = save_pretrained(engine, tokenizer, ctx.work_dir / "model")
    ctx.log_metrics(final, engine.step_count)
    headline = "eval/accuracy" if "eval/accuracy" in final else "train/accuracy"
    return StageResult(outputs={"model": out}, metrics=final, headline=headline, fingerprint=engine.fingerprint())
