"""The `evaluate` stage: sample n completions per prompt, score them, report accuracy, pass@k, best-of-n.

Best-of-n (`best_of: [reward, ...]`): per prompt, the completion a reward (a reward model, a PRM)
scores highest is kept, and the share of kept completions that are correct is reported. Against it:
`accuracy` (a random pick) and `pass_at_n` (an oracle pick). With `group_by: COLUMN` each is also
reported per value of that row column (e.g. `task`, for one figure per task of a mixed test set).
"""

from __future__ import annotations

import json
from collections import defaultdict

from alignflow.core.train.datasets import read_rows
from alignflow.core.errors import SpecError
from alignflow.core.train.dist import rank_and_world
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import (Scored, accuracy_metrics, dataset_schema, generate_and_score,
                                           held_episodes, loaded_sampler, reward_set)


def grouped_accuracy(scored: Scored, column: str) -> dict[str, float]:
    """accuracy/<column>_<value> for each value of a row column (e.g. the task's difficulty level)."""
    hits, totals = defaultdict(int), defaultdict(int)
    for i, ok in zip(scored.generation.prompt_index, scored.correct):
        value = scored.rows[i].get(column)
        hits[value] += ok
        totals[value] += 1
    return {f"accuracy/{column}_{v}": hits[v] / totals[v] for v in sorted(totals, key=str)}


def best_picks(scored: Scored, reward: str) -> dict[int, bool]:
    """Per prompt, whether the completion `reward` scores highest (the first of equals) is correct."""
    values = scored.rewards.values[reward]
    best: dict[int, tuple[float, int]] = {}  # prompt -> (score, -index) of its pick so far
    for j, i in enumerate(scored.generation.prompt_index):
        key = (values[j] if values[j] is not None else float("-inf"), -j)
        best[i] = max(best.get(i, key), key)
    return {i: scored.correct[-j] for i, (_, j) in best.items()}


def best_of_n(scored: Scored, reward: str) -> float:
    """Accuracy when each prompt keeps the completion `reward` scores highest (the first of equals)."""
    picks = best_picks(scored, reward)
    return sum(picks.values()) / len(picks)


def grouped_selection(scored: Scored, column: str, best_of: list[str]) -> dict[str, float]:
    """Per value of a row column: pass_at_<n>/<column>_<value> (an oracle pick) and
    best_of_<n>/<reward>/<column>_<value> for each selector, over that value's prompts."""
    groups: dict = defaultdict(list)
    for i, row in enumerate(scored.rows):
        groups[row.get(column)].append(i)
    counts = scored.counts()
    picks = {name: best_picks(scored, name) for name in best_of}
    metrics = {}
    for v in sorted(groups, key=str):
        prompts = groups[v]
        metrics[f"pass_at_{scored.n}/{column}_{v}"] = sum(counts[i] > 0 for i in prompts) / len(prompts)
        for name in best_of:
            metrics[f"best_of_{scored.n}/{name}/{column}_{v}"] = sum(picks[name][i] for i in prompts) / len(prompts)
    return metrics


def write_samples(scored: Scored, path) -> None:
    """One JSON line per completion: prompt, completion, each reward's value, correct. An episode's prompt is
    what the model read first, the messages its environment started it with (`reset`), not the row's prompt:
    their contents as `prompt`, the messages themselves as `first_messages`."""
    conversations = (scored.generation.episodes or {}).get("messages")
    with open(path, "w", encoding="utf-8") as f:
        for j, i in enumerate(scored.generation.prompt_index):
            row = {"prompt": scored.rows[i]["prompt"], "completion": scored.generation.texts[j],
                   "rewards": {k: v[j] for k, v in scored.rewards.values.items()}, "correct": scored.correct[j]}
            if conversations is not None:
                first = first_messages(conversations[j])
                row.update(prompt="\n\n".join(m["content"] for m in first), first_messages=first)
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


def first_messages(conversation: list[dict]) -> list[dict]:
    """The messages of an episode's conversation before the model's first turn."""
    end = next((k for k, m in enumerate(conversation) if m.get("role") == "assistant"), len(conversation))
    return [dict(m) for m in conversation[:end]]


def run_evaluate(ctx: StageContext) -> StageResult:
    """Score `model` on `dataset` (prompt + answer rows; with an environment, `answer` where read); the samples
    are the stage's dataset output."""
    s = ctx.settings
    rewards = reward_set(ctx)
    names = [r.name for r in rewards.rewards]  # a reward listed twice is NAME_i, i its place in the list
    for name in s.best_of:
        if name not in names:
            raise SpecError(f"stage {ctx.name!r}, settings.best_of: {name!r} is not one of the stage's "
                            f"rewards ({', '.join(names)})")
    rows = read_rows(ctx.inputs["dataset"], dataset_schema(ctx))[: s.limit]
    with loaded_sampler(ctx) as (sampler, tokenizer), held_episodes(ctx) as episodes:
        scored = generate_and_score(sampler, tokenizer, rows, s.n, s.generation, ctx.seed, rewards, shard=True,
                                    episodes=episodes)
    metrics = accuracy_metrics(scored, s.k)
    if s.group_by and s.group_by in rows[0]:
        metrics.update(grouped_accuracy(scored, s.group_by))
        if s.best_of or s.n > 1:
            metrics.update(grouped_selection(scored, s.group_by, s.best_of))
    for name in s.best_of:
        metrics[f"best_of_{s.n}/{name}"] = best_of_n(scored, name)
    samples = ctx.work_dir / "samples.jsonl"
    if rank_and_world()[0] == 0:  # every rank holds every sample; one writes them
        write_samples(scored, samples)
    return StageResult(outputs={"dataset": samples}, metrics=metrics, headline="accuracy")
