"""Judge-training rows from scored samples: the evaluation-fine-tuning (EFT) data of Self-Rewarding LMs."""

from __future__ import annotations

import random

from alignflow.core import PluginConfig, Selector, hookimpl
from alignflow.plugins.judge import placeholders


def check_samples(rows: list[dict], selector: str) -> None:
    """A ValueError naming the first row that is not an `evaluate` stage's scored sample."""
    for i, row in enumerate(rows):
        missing = {"prompt", "completion", "correct"} - row.keys()
        if missing:
            raise ValueError(f"{selector}: row {i} has no {', '.join(sorted(missing))} (expected an "
                             "evaluate stage's samples)")


def balanced(rows: list[dict], rng: random.Random) -> list[int]:
    """Every row of the rarer verdict (`correct`) and a seeded draw of as many of the other, in input order."""
    yes = [i for i, r in enumerate(rows) if r["correct"]]
    no = [i for i, r in enumerate(rows) if not r["correct"]]
    small, large = sorted([yes, no], key=len)
    return sorted(small + rng.sample(large, len(small)))


class JudgeExamples(Selector):
    """Map each scored sample (an `evaluate` stage's rows: prompt, completion, correct) to an SFT row that teaches
    the model to judge: prompt = `template` filled with the sample's prompt and completion, completion = `yes`
    when the verifier called the sample correct, else `no`. Self-Rewarding LMs (Yuan et al. 2024) train the
    judge skill this way (their EFT data, from ranked human responses and a 5-point rubric); here the verdicts
    are the verifier's. `balance` keeps as many `no` as `yes` rows (a seeded draw of the larger class), so the
    judge cannot score well by always giving the common verdict. `answers` (default) also keeps each correct
    sample as an ordinary SFT row (prompt, completion): the paper's M1 trains on instruction data and judge
    data together, and a tiny model fine-tuned on judge rows alone forgets how to answer (measured: greedy test
    accuracy 0.258 -> 0, every answer a verdict). Rows keep no other key: this selector maps, it does not
    only filter."""

    class Config(PluginConfig):
        template: str = "{prompt}{completion}?"  # with {prompt} and {completion}; the `judge` reward's template
        yes: str = "Y"  # the verdict text of a correct sample
        no: str = "N"  # the verdict text of an incorrect one
        balance: bool = True  # as many `no` rows as `yes` rows, by a seeded draw of the larger class
        answers: bool = True  # also each correct sample as an SFT row, so answering is rehearsed

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        c = self.config
        names = placeholders(c.template)
        if not names or names - {"prompt", "completion"}:
            raise ValueError(f"judge_examples: template {c.template!r} must use {{prompt}} and {{completion}} only")
        check_samples(rows, "judge_examples")
        judged = [{"prompt": c.template.format(prompt=r["prompt"], completion=r["completion"]),
                   "completion": c.yes if r["correct"] else c.no} for r in rows]
        keep = balanced(rows, rng) if c.balance else range(len(rows))
        answers = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows if r["correct"]]
        return [judged[i] for i in keep] + (answers if c.answers else [])


@hookimpl
def register_selectors(register):
    register("judge_examples", JudgeExamples)
