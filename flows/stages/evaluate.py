"""The `evaluate` stage: sample n completions per prompt, score them, report accuracy, pass@k, best-of-n.

Best-of-n (`best_of: [reward, ...]`): per prompt, the completion a reward (a reward model, a PRM)
scores highest is kept, and the share of kept completions that are correct is reported. Against it:
`accuracy` (a random pick) and `pass_at_n` (an oracle pick).
"""

from __future__ import annotations

import json
from collections import defaultdict

from alignflow.core.train.datasets import load_rows
from alignflow.core.errors import SpecError
from alignflow.core.train.dist import rank_and_world
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import (Scored, accuracy_metrics, episodes_of, generate_and_score, loaded_sampler,
                                           reward_set)


def grouped_accuracy(scored: Scored, column: str) -> dict[str, float]:
    """accuracy/<column>_<value> for each value of a row column (e.g. the task's difficulty level)."""
    hits, totals = defaultdict(int), defaultdict(int)
    for i, ok in zip(scored.generation.prompt_index, scored.correct):
        value = scored.rows[i].get(column)
        hits[value] += ok
        totals[value] += 1
    return {f"accuracy/{column}_{v}": hits[v] / totals[v] for v in sorted(totals, key=str)}


def best_of_n(scored: Scored, reward: str) -> float:
    """Accuracy when each prompt keeps the completion `reward` scores highest (the first of equals)."""
    values = scored.rewards.values[reward]
    best: dict[int, tuple[float, int]] = {}  # prompt -> (score, -index) of its pick so far
    for j, i in enumerate(scored.generation.prompt_index):
        key = (values[j] if values[j] is not None else float("-inf"), -j)
        best[i] = max(best.get(i, key), key)
    return sum(scored.correct[-j] for _, j in best.values()) / len(best)


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
    rewards = reward_set(ctx)
    names = [r.name for r in rewards.rewards]  # a reward listed twice is NAME_i, i its place in the list
    for name in s.best_of:
        if name not in names:
            raise SpecError(f"stage {ctx.name!r}, settings.best_of: {name!r} is not one of the stage's "
                            f"rewards ({', '.join(names)})")
    rows = load_rows(ctx.inputs["dataset"], "prompt_answer").to_list()[: s.limit]
    with loaded_sampler(ctx) as (sampler, tokenizer):
        scored = generate_and_score(sampler, tokenizer, rows, s.n, s.generation, ctx.seed, rewards, shard=True,
                                    episodes=episodes_of(ctx))
    metrics = accuracy_metrics(scored, s.k)
    if s.group_by and s.group_by in rows[0]:
        metrics.update(grouped_accuracy(scored, s.group_by))
    for name in s.best_of:
        metrics[f"best_of_{s.n}/{name}"] = best_of_n(scored, name)
    samples = ctx.work_dir / "samples.jsonl"
    if rank_and_world()[0] == 0:  # every rank holds every sample; one writes them
        write_samples(scored, samples)
    return StageResult(outputs={"dataset": samples}, metrics=metrics, headline="accuracy")
