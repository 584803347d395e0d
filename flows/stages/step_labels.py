"""The `step_labels` stage: Math-Shepherd step labels (Wang et al. 2024, arXiv 2312.08935) by rollouts.

`n` solutions are sampled per prompt from `model` and each distinct one is split into steps at
`step_separator`. Step i's label says whether the solution can still reach the answer after step i:
the prefix (prompt + steps 1..i) is completed `rollouts` times by `completer` (default: `model`; the
paper fine-tunes a separate completer) and the completions are judged by the first reward. Hard
label: 1 when any completion is correct; soft: the share that are. The last step's prefix is the
whole solution, so its label is the solution's own correctness; with hard labels a correct solution
needs no rollouts, being itself a correct completion of each of its prefixes. Equal prefixes of one
prompt are completed once. Rows: the prompt's columns, `completion`, `correct`, `steps` and
`step_labels`, ready for a `prm` stage.
"""

from __future__ import annotations

from alignflow.core import seeds
from alignflow.core.train.datasets import read_rows
from alignflow.core.train.steps import split_steps
from alignflow.core.train.dist import rank_and_world
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import (CHUNK, chunks, columns_for, every_rank, generate_and_score, judge,
                                            loaded_sampler, reward_set)
from alignflow.flows.stages.select import write_jsonl


def prefix(steps: list[str], i: int, separator: str) -> str:
    """The text of steps 0..i, each followed by the separator."""
    return "".join(step + separator for step in steps[: i + 1])


def solutions_and_prefixes(scored, s) -> tuple[list[tuple], list[tuple[int, str]]]:
    """The distinct solutions per prompt (prompt index, text, steps, correct), and every step prefix whose
    label needs rollouts, once per prompt."""
    solutions, seen = [], set()
    for i, text, ok in zip(scored.generation.prompt_index, scored.generation.texts, scored.correct):
        steps = split_steps(text, s.step_separator)
        if steps and (i, text) not in seen:
            seen.add((i, text))
            solutions.append((i, text, steps, ok))
    todo = list(dict.fromkeys(
        (i, prefix(steps, k, s.step_separator))
        for i, _, steps, ok in solutions if not witnessed(ok, s)
        for k in range(len(steps) - 1)))
    return solutions, todo


def witnessed(ok: bool, s) -> bool:
    """With hard labels a correct solution labels its own prefixes."""
    return ok and s.label == "hard"


def run_step_labels(ctx: StageContext) -> StageResult:
    """Sample solutions, complete their step prefixes, write labelled `steps` rows to `data.jsonl`."""
    s = ctx.settings
    rows = read_rows(ctx.inputs["dataset"], "prompt_answer")
    rewards = reward_set(ctx)
    with loaded_sampler(ctx, "model") as (sampler, tokenizer):
        scored = generate_and_score(sampler, tokenizer, rows, s.n, s.generation, ctx.seed, rewards, shard=True)
        solutions, todo = solutions_and_prefixes(scored, s)
        if "completer" not in ctx.inputs:
            hits = rollout_hits(ctx, sampler, tokenizer, rows, todo, rewards)
    if "completer" in ctx.inputs:  # one model in memory at a time
        with loaded_sampler(ctx, "completer") as (sampler, tokenizer):
            hits = rollout_hits(ctx, sampler, tokenizer, rows, todo, rewards)

    out = []
    for i, text, steps, ok in solutions:
        counts = [s.rollouts if witnessed(ok, s) else hits[(i, prefix(steps, k, s.step_separator))]
                  for k in range(len(steps) - 1)]
        labels = [int(h > 0) if s.label == "hard" else h / s.rollouts for h in counts] + [int(ok)]
        out.append({**rows[i], "completion": text, "correct": ok, "steps": steps, "step_labels": labels})
    path = ctx.work_dir / "data.jsonl"
    if rank_and_world()[0] == 0:  # every rank holds every sample; one writes them
        write_jsonl(out, path)
    labels = [v for row in out for v in row["step_labels"]]
    metrics = {
        "accuracy": sum(scored.correct) / len(scored.correct),
        "solutions": float(len(out)),
        "steps": float(len(labels)),
        "rollouts": float(len(todo) * s.rollouts),
        "steps/positive": sum(v > 0.5 for v in labels) / max(len(labels), 1),
        "solutions/correct": sum(row["correct"] for row in out) / max(len(out), 1),
    }
    ctx.log_metrics(metrics, 0)
    return StageResult(outputs={"dataset": path}, metrics=metrics, headline="steps")


def rollout_hits(ctx: StageContext, sampler, tokenizer, rows: list[dict], todo: list[tuple[int, str]],
                 rewards) -> dict[tuple[int, str], int]:
    """For each (prompt index, prefix): how many of `rollouts` completions of it are correct.

    The ranks of a process group share the prefixes in chunks (`chunks`), each judging its own rollouts.
    """
    if not todo:
        return {}
    s = ctx.settings
    prompts = [{**rows[i], "prompt": rows[i]["prompt"] + text} for i, text in todo]
    pieces = []
    for lo, part in chunks(sampler, tokenizer, prompts, s.rollouts, s.generation, seeds.step_label_rollouts(ctx.seed),
                           shard=True):
        keys = [todo[lo + j] for j in part.prompt_index]
        texts = [text + cont for (_, text), cont in zip(keys, part.texts)]
        _, correct = judge(rewards, [rows[i]["prompt"] for i, _ in keys], texts,
                           columns_for(prompts[lo: lo + CHUNK], part))
        pieces.append((lo, keys, correct))
    hits = dict.fromkeys(todo, 0)
    for _, keys, correct in every_rank(pieces):
        for key, ok in zip(keys, correct):
            hits[key] += ok
    return hits
