"""Registers the example algorithms (a preference loss and an RL algorithm), reward and environment with alignflow."""

import re

from alignflow.core import hookimpl

from alignflow_plugin_example.guess import Guess
from alignflow_plugin_example.hinge import Hinge
from alignflow_plugin_example.reinforce import Reinforce

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def answer_digits(prompts, completions, answer, **columns):
    """Share of the reference answer's digits, position by position, that the completion's answer matches."""
    scores = []
    for completion, reference in zip(completions, answer):
        found = _ANSWER.search(completion)
        if found is None:
            scores.append(0.0)
            continue
        got, want = found.group(1).strip(), str(reference).strip()
        width = max(len(got), len(want), 1)
        got, want = got.rjust(width), want.rjust(width)
        scores.append(sum(a == b for a, b in zip(got, want)) / width)
    return scores


@hookimpl
def register_algorithms(register):
    register("hinge", Hinge)
    register("reinforce", Reinforce)


@hookimpl
def register_rewards(register):
    register("answer_digits", answer_digits)


@hookimpl
def register_environments(register):
    register("guess", Guess)
