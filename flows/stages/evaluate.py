"""The `evaluate` stage: sample n completions per prompt, score them, report accuracy and pass@k."""

from __future__ import annotations

import json
from collections import defaultdict

from alignflow.core.data import load_rows
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import Scored, accuracy_metrics, generate_and_score, reward_set
from alignflow.flows.stages.training import load_model_for, load_tokenizer_for, model_source, plugin


def grouped_accuracy(scored: Scored, column: str) -> dict[str, float]:
    """accuracy/<column>_<value> for each value of a row column (e.g. the task's difficulty level)."""
    hits, totals = defaultdict(int), defaultdict(int)
    for i, ok in zip(scored.generation.prompt_index, scored.correct):
        value = scored.rows[i].get(column)
        hits[value] += ok
        totals[value] += 1
    return {f"accuracy/{column}_{v}": hits[v] / totals[v] for v in sorted(totals, key=str)}


def write_samples(scored: Scored, path) -> None:
    """One JSON line per completion: prompt, completion, each reward's value, correct."""
    with open(path, "w", encoding="utf-8") as f:
        for j, i in enumerate(scored.generation.prompt_index):
            row = {"prompt": scored.rows[i]["prompt"], "completion": scored.generation.texts[j],
                   "rewards": {k: v[j] for k, v in scored.rewards.values.items()}, "correct": scored.correct[j]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def run_evaluate(ctx: StageContext) -> StageResult:
    """Score `model` on `dataset` (prompt + answer rows); the samples are the stage's dataset output."""
    s = ctx.settings
    with model_source(ctx) as src:
        tokenizer, model = load_tokenizer_for(ctx, src), load_model_for(ctx, src, dtype="fp32")
    rows = load_rows(ctx.inputs["dataset"], "prompt_answer").to_list()[: s.limit]
    sampler = plugin(ctx, ctx.spec.sampler, ctx.plugins.samplers, "sampler")
    sampler.load(model, tokenizer)
    scored = generate_and_score(sampler, tokenizer, rows, s.n, s.generation, ctx.seed, reward_set(ctx))
    metrics = accuracy_metrics(scored, s.k)
    if s.group_by and s.group_by in rows[0]:
        metrics.update(grouped_accuracy(scored, s.group_by))
    samples = ctx.work_dir / "samples.jsonl"
    write_samples(scored, samples)
    return StageResult(outputs={"dataset": samples}, metrics=metrics, headline="accuracy")
