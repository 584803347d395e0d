"""The `rejection_sampling` stage: sample `n` completions per prompt, score them, keep what passes.

`output: sft` writes the best-scoring completion of each prompt when it is correct (R1's rejection
sampling SFT data; with an environment, the best episode's conversation as a `messages` row, with the
JSON schemas of the tools it was shown as `tools`, which an sft stage learns every model turn of);
`output: pairs` writes (correct, incorrect) pairs for each prompt that has both
(preference data sampled from the policy): the best correct completion against the best incorrect
one, and with `pairs_per_prompt: k` against up to k distinct incorrect texts, best first; `output: lists` writes
ranked lists for listwise losses (LarPO): the best correct completion, then `list_size - 1` distinct completions
of lower total, best first (with a 0/1 verifier: incorrect ones), as `completions` with their `scores`, for each
prompt that has that many; `output: self_play`
reads prompt/completion rows (SFT data) and writes SPIN's pairs: the data's completion as chosen against the
model's own first sample that differs from it (rewards only score the samples for the metrics). Best means
the highest total reward, first on ties, so with one 0/1 verifier the first correct and the first
incorrect samples are kept. Seeded: the same
model, prompts and seed write the same rows.
"""

from __future__ import annotations

import json

from alignflow.core.errors import SpecError
from alignflow.core.train.datasets import read_rows
from alignflow.core.train.dist import rank_and_world
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import (Scored, accuracy_metrics, dataset_schema, generate_and_score,
                                           held_episodes, loaded_sampler, reward_set)
from alignflow.flows.stages.select import write_jsonl


def best(candidates: list[int], total: list[float]) -> int | None:
    """The highest-total candidate, the first of equals; None when there is none."""
    return max(candidates, key=lambda j: (total[j], -j)) if candidates else None


def by_prompt(scored: Scored) -> list[tuple[list[int], list[int]]]:
    """(correct, incorrect) completion indices of each prompt, in sampling order."""
    groups = [([], []) for _ in scored.rows]
    for j, (i, ok) in enumerate(zip(scored.generation.prompt_index, scored.correct)):
        groups[i][0 if ok else 1].append(j)
    return groups


def distinct_best(candidates: list[int], texts: list[str], total: list[float], k: int) -> list[int]:
    """Up to `k` candidates with distinct texts, highest total first (the first of equals)."""
    seen, out = set(), []
    for j in sorted(candidates, key=lambda j: (-total[j], j)):
        if texts[j] not in seen and len(out) < k:
            seen.add(texts[j])
            out.append(j)
    return out


def select_rows(scored: Scored, output: str, pairs_per_prompt: int = 1, list_size: int = 4) -> list[dict]:
    """The dataset rows to write: the prompt's other columns kept, plus the kept completions' rewards."""
    texts, total = scored.generation.texts, scored.rewards.total
    episodes = scored.generation.episodes
    tools = {"tools": json.dumps(scored.generation.tools)} if scored.generation.tools else {}  # alike in every row
    out = []
    for row, (correct, incorrect) in zip(scored.rows, by_prompt(scored)):
        if output == "sft":
            top = best(correct + incorrect, total)
            if top in correct and episodes is not None:  # an episode: its conversation, every turn to learn
                kept = {k: v for k, v in row.items() if k not in ("prompt", "completion")}
                out.append({**kept, "messages": episodes["messages"][top], **tools, "reward": total[top]})
            elif top in correct:  # the best sample must itself be correct, not merely some sample
                out.append({**row, "completion": texts[top], "reward": total[top]})
        elif output == "self_play":
            own = [j for j in sorted(correct + incorrect) if texts[j] != row["completion"]]
            if own:  # a sample equal to the data gives SPIN no signal (its two log-ratios cancel)
                out.append({**{k: v for k, v in row.items() if k != "completion"}, "chosen": row["completion"],
                            "rejected": texts[own[0]], "rejected_reward": total[own[0]]})
        elif output == "lists" and correct:
            win = best(correct, total)
            worse = distinct_best([j for j in correct + incorrect if total[j] < total[win] and texts[j] != texts[win]],
                                  texts, total, list_size - 1)
            if len(worse) == list_size - 1:
                out.append({**row, "completions": [texts[j] for j in [win, *worse]],
                            "scores": [total[j] for j in [win, *worse]]})
        elif output == "pairs" and correct and incorrect:
            win = best(correct, total)
            for lose in distinct_best(incorrect, texts, total, pairs_per_prompt):
                out.append({**row, "chosen": texts[win], "rejected": texts[lose],
                            "chosen_reward": total[win], "rejected_reward": total[lose]})
    return out


def run_rejection_sampling(ctx: StageContext) -> StageResult:
    """Generate, score, select and write `data.jsonl`; report accuracy, pass@n and what was kept."""
    s = ctx.settings
    if ctx.spec.environment is not None and s.output != "sft":
        raise SpecError(f"stage {ctx.name!r}, settings.output: {s.output!r} writes single-turn pairs; with an "
                        "environment only `sft` (each prompt's best episode as a conversation) is supported")
    rows = read_rows(ctx.inputs["dataset"], dataset_schema(ctx))
    with loaded_sampler(ctx) as (sampler, tokenizer), held_episodes(ctx) as episodes:
        scored = generate_and_score(sampler, tokenizer, rows, s.n, s.generation, ctx.seed, reward_set(ctx),
                                    shard=True, episodes=episodes)

    kept = select_rows(scored, s.output, s.pairs_per_prompt, s.list_size)
    out = ctx.work_dir / "data.jsonl"
    if rank_and_world()[0] == 0:  # every rank holds every sample; one writes them
        write_jsonl(kept, out)
    groups = by_prompt(scored)
    metrics = {
        **accuracy_metrics(scored, sorted({1, s.n})),
        "rows_written": float(len(kept)),
        "prompts": float(len(rows)),
        "pair_share": sum(bool(c and w) for c, w in groups) / len(groups),
    }
    ctx.log_metrics(metrics, 0)
    return StageResult(outputs={"dataset": out}, metrics=metrics, headline="rows_written")
