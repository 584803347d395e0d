"""GenRM training rows from verifier-labelled samples: verification by next-token prediction (arXiv 2408.15240)."""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field, field_validator, model_validator

from alignflow.core import PluginConfig, Selector, hookimpl
from alignflow.core.task.arithmetic import extract_answer, parse, work
from alignflow.plugins.judge import placeholders
from alignflow.plugins.judge_examples import balanced, check_samples

# The verification question of Zhang et al. 2024 ("Is the answer correct (Yes/No)?") after the problem and
# the candidate solution; the `genrm` reward's default, so the verifier is asked what it was trained on.
TEMPLATE = "{prompt}{completion} Is the answer correct (Yes/No)?"
YES, NO = " Yes", " No"
_THINK = re.compile(r"<think>(.*?)</think>", re.S)


def check_template(template: str) -> str:
    """`template` when it uses {prompt} and {completion} and nothing else; a ValueError otherwise."""
    names = placeholders(template)
    if names != {"prompt", "completion"}:
        raise ValueError(f"template {template!r} must use {{prompt}} and {{completion}}, and nothing else")
    return template


class VerdictConfig(PluginConfig):
    """The verification prompt and the two verdicts: the rows' and the `genrm` reward's, which must agree."""

    template: str = Field(TEMPLATE, description="with {prompt} and {completion}")
    yes: str = YES  # the verdict text of a correct candidate
    no: str = NO  # the verdict text of an incorrect one

    _template = field_validator("template")(classmethod(lambda cls, v: check_template(v)))

    @model_validator(mode="after")
    def _distinct_verdicts(self):
        if not self.yes or not self.no or self.yes == self.no:
            raise ValueError(f"yes {self.yes!r} and no {self.no!r} must be two different non-empty texts")
        return self


def recheck(prompt: str, completion: str) -> str:
    """A verification rationale written by the arithmetic task's checker: each worked step of `completion`
    compared with the step the exact column arithmetic gives, up to the first that differs, then its answer
    against the true one: ``7+8=15 ok; 3+4=7 wrong 3+4+1=8; answer 75 wrong 85.``"""
    parsed = parse(prompt)
    if parsed is None:
        raise ValueError(f"prompt {prompt!r} is not an arithmetic problem (a+b=, a-b=, a*b=)")
    steps, answer = work(*parsed)
    think = _THINK.findall(completion)
    written = think[-1].split() if think else []
    parts = []
    for i, step in enumerate(written):
        if i >= len(steps):
            parts.append(f"{step} extra")
            break
        if step != steps[i]:
            parts.append(f"{step} wrong {steps[i]}")
            break
        parts.append(f"{step} ok")
    else:
        if len(written) < len(steps):
            parts.append(f"missing {steps[len(written)]}")
    given = extract_answer(completion)
    given = "none" if not given else given.split()[0]  # one word: the rationale stays one line
    parts.append(f"answer {given} ok" if given == answer else f"answer {given} wrong {answer}")
    return "; ".join(parts) + "."


class GenRMExamples(Selector):
    """Map each verifier-labelled sample (an `evaluate` stage's rows: prompt, completion, correct) to a GenRM row:
    prompt = `template` filled with the problem and the candidate, completion = rationale + `yes`/`no` by the
    verifier's label. `rationale: steps` (GenRM-CoT) writes the verification by recomputation of `recheck`; the
    paper had a stronger model write its rationales, here the task's exact checker writes them (so they are
    always right, and the verdict follows the answer check, as the label does). `rationale: none` is direct
    GenRM: the verdict alone. `balance` keeps as many `no` as `yes` rows (a seeded draw of the larger class),
    since the cold start's samples are mostly one or the other. `solutions` also keeps each correct sample as an
    SFT row: the paper's joint objective (its λ) with the solution-generation loss; off by default."""

    class Config(VerdictConfig):
        # steps: a recomputation of each step before the verdict (GenRM-CoT); none: the verdict alone
        rationale: Literal["steps", "none"] = "steps"
        balance: bool = True  # as many `no` rows as `yes` rows, by a seeded draw of the larger class
        solutions: bool = False  # also each correct sample as an SFT row (the paper's joint SFT objective)

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        c = self.config
        check_samples(rows, "genrm_examples")
        out = []
        for i, r in enumerate(rows):
            try:
                why = " " + recheck(r["prompt"], r["completion"]) if c.rationale == "steps" else ""
            except ValueError as e:
                raise ValueError(f"genrm_examples: row {i}, field prompt: {e}") from None
            out.append({"prompt": c.template.format(prompt=r["prompt"], completion=r["completion"]),
                        "completion": why + (c.yes if r["correct"] else c.no)})
        keep = balanced(rows, rng) if c.balance else range(len(rows))
        solutions = [{"prompt": r["prompt"], "completion": r["completion"]} for r in rows if r["correct"]]
        return [out[i] for i in keep] + (solutions if c.solutions else [])


@hookimpl
def register_selectors(register):
    register("genrm_examples", GenRMExamples)
