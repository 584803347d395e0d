"""The `critique_revise` stage: Constitutional AI's critique -> revision loop (SL-CAI; Bai et al. 2022,
arXiv 2212.08073), the AI feedback of RLAIF.

For each prompt of `dataset` the model writes `n` answers. For each answer a principle is drawn from the
`constitution` file (seeded by the stage seed), the model critiques its answer against it
(`critique_template`: {prompt} {completion} {principle}) and then revises it (`revision_template`: the same and
{critique}); `revisions` rounds, each revising the last revision under a principle drawn anew. `output: pairs`
writes (prompt, chosen = final revision, rejected = original) for DPO, dropping revisions equal to their
original; `output: sft` writes (prompt, completion = final revision) for SL-CAI. Either way the row keeps the
prompt's columns, `principles` and `critiques` (one per round). With rewards, both texts are scored
(`chosen_score`/`rejected_score`, or `score`/`original_score`) and `keep: improved` keeps only rows whose
revision scores higher: the model's own feedback, checked by a verifier. Critiques are stripped of surrounding
whitespace (they are context); answers and revisions are written as generated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from alignflow.core import seeds
from alignflow.core.task.constitution import draw_principles, read_principles
from alignflow.core.train.datasets import read_rows
from alignflow.core.errors import SpecError
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import critique_rows
from alignflow.core.spec.schema import DEFAULT_SAMPLER, PluginRef
from alignflow.flows.stages import StageContext, StageResult
from alignflow.flows.stages.scoring import columns_for, generate, judge, loaded_sampler, reward_set
from alignflow.flows.stages.select import write_jsonl


@dataclass
class Revised:
    """The answers (prompt-major, `n` per prompt), each one's principles and critiques by round, its final
    revision, and with rewards the (original, revision) reward totals and correctness."""

    prompt_index: list[int]
    original: list[str]
    principles: list[list[str]]
    critiques: list[list[str]]
    revised: list[str]
    scores: tuple[list[float], list[float]] | None = None
    correct: tuple[list[bool], list[bool]] | None = None


def build_rows(rows: list[dict], revised: Revised, output: str, keep: str = "all") -> list[dict]:
    """The dataset rows to write, in answer order: the prompt's other columns kept."""
    out = []
    for j, i in enumerate(revised.prompt_index):
        original, revision = revised.original[j], revised.revised[j]
        scores = None if revised.scores is None else (revised.scores[0][j], revised.scores[1][j])
        if keep == "improved" and not scores[1] > scores[0]:
            continue
        trace = {"principles": revised.principles[j], "critiques": revised.critiques[j]}
        if output == "pairs":
            if revision == original:  # equal texts give DPO no signal (their log-ratios cancel)
                continue
            row = {**rows[i], "chosen": revision, "rejected": original, **trace}
            if scores is not None:
                row.update(chosen_score=scores[1], rejected_score=scores[0])
        else:
            row = {**rows[i], "completion": revision, "original": original, **trace}
            if scores is not None:
                row.update(score=scores[1], original_score=scores[0])
        out.append(row)
    return out


def critique_and_revise(sampler, tokenizer, rows: list[dict], answers: Generation, principles: list[str], s,
                        seed: int) -> tuple[Revised, Generation, list[int]]:
    """Every answer critiqued and revised `s.revisions` times: the Revised record, the last revisions as a
    Generation indexed like the answers (for the rewards' columns), and every critique's token count."""
    drawn = draw_principles(principles, len(answers), s.revisions, seed)
    current, last = list(answers.texts), answers
    critiques: list[list[str]] = [[] for _ in current]
    critique_tokens: list[int] = []
    for r in range(s.revisions):
        fields = [{"prompt": rows[i]["prompt"], "completion": text, "principle": drawn[j][r]}
                  for j, (i, text) in enumerate(zip(answers.prompt_index, current))]
        asked = generate(sampler, tokenizer, [{"prompt": s.critique_template.format(**f)} for f in fields], 1,
                         s.generation, seeds.critique(seed, 2 * r + 1))
        for j, text in enumerate(asked.texts):
            critiques[j].append(text.strip())
        critique_tokens += asked.lengths
        requests = [{"prompt": s.revision_template.format(**f, critique=critiques[j][r])}
                    for j, f in enumerate(fields)]
        last = generate(sampler, tokenizer, requests, 1, s.generation, seeds.critique(seed, 2 * r + 2))
        current = list(last.texts)
    final = dataclasses.replace(last, prompt_index=list(answers.prompt_index))
    return Revised(list(answers.prompt_index), list(answers.texts), drawn, critiques, current), final, critique_tokens


def run_critique_revise(ctx: StageContext) -> StageResult:
    """Answer, critique, revise, score when there are rewards, and write `data.jsonl`."""
    s = ctx.settings
    if s.keep == "improved" and not ctx.spec.rewards:
        raise SpecError(f"stage {ctx.name!r}, settings.keep: 'improved' compares the rewards' scores of the "
                        "revision and the original; list at least one reward in the stage, or keep: all")
    principles = read_principles(ctx.inputs["constitution"])
    rows = read_rows(ctx.inputs["dataset"], critique_rows(bool(ctx.spec.rewards)))
    rewards = reward_set(ctx) if ctx.spec.rewards else None
    if ctx.spec.sampler is None:  # parse_spec fills it in; a spec built by hand may not have
        ctx = dataclasses.replace(ctx, spec=ctx.spec.model_copy(update={"sampler": PluginRef(name=DEFAULT_SAMPLER)}),
                                  resolved=None)  # resolved again, with the sampler
    with loaded_sampler(ctx) as (sampler, tokenizer):
        answers = generate(sampler, tokenizer, rows, s.n, s.generation, ctx.seed)
        revised, final, critique_tokens = critique_and_revise(sampler, tokenizer, rows, answers, principles, s,
                                                              ctx.seed)

    metrics = {
        "prompts": float(len(rows)),
        "answers": float(len(answers)),
        "revised_share": sum(a != b for a, b in zip(revised.original, revised.revised)) / len(answers),
        "critique_length/mean": sum(critique_tokens) / len(critique_tokens),
        "response_length/mean": sum(answers.lengths) / len(answers),
        "revision_length/mean": sum(final.lengths) / len(final),
        "revision_length/truncated": sum(final.truncated) / len(final),
    }
    if rewards is not None:
        prompts = [rows[i]["prompt"] for i in answers.prompt_index]
        before, ok_before = judge(rewards, prompts, revised.original, columns_for(rows, answers))
        after, ok_after = judge(rewards, prompts, revised.revised, columns_for(rows, final))
        revised.scores, revised.correct = (before.total, after.total), (ok_before, ok_after)
        metrics.update(score_metrics(revised))
        metrics.update({f"original/{k}": v for k, v in before.metrics.items()})
        metrics.update({f"revision/{k}": v for k, v in after.metrics.items()})

    kept = build_rows(rows, revised, s.output, s.keep)
    out = ctx.work_dir / "data.jsonl"
    write_jsonl(kept, out)
    metrics["rows_written"] = float(len(kept))
    ctx.log_metrics(metrics, 0)
    return StageResult(outputs={"dataset": out}, metrics=metrics, headline="rows_written")


def score_metrics(revised: Revised) -> dict[str, float]:
    """Mean reward total and accuracy (the first reward's verdict) of the originals and the revisions, and the
    share of revisions the rewards score higher and lower than their original."""
    (before, after), (ok_before, ok_after) = revised.scores, revised.correct
    n = len(before)
    return {
        "score/original": sum(before) / n,
        "score/revision": sum(after) / n,
        "accuracy/original": sum(ok_before) / n,
        "accuracy/revision": sum(ok_after) / n,
        "improved_share": sum(b > a for a, b in zip(before, after)) / n,
        "worse_share": sum(b < a for a, b in zip(before, after)) / n,
    }
