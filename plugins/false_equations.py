"""false_equations cost: integer equations in a completion whose two sides differ, C <= 0 when it states none."""

from __future__ import annotations

import re

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rewards import Scores

# `a op b [op c ...] = v` over non-negative integers and + - *, the right side signed. A left side starts where
# no digit or operator precedes it, so "-3+5=2" is skipped rather than misread as 3+5=2. The bundled task's
# borrow "12-7=5" (1 lent to the top digit 2) and carry "3*9+3=30" are ordinary integer equations.
EQUATION = re.compile(r"(?<![\d+\-*])(\d{1,30}(?:[+\-*]\d{1,30})+)=(-?\d{1,60})")
TERM = re.compile(r"([+\-]?)(\d+(?:\*\d+)*)")


def evaluate(expression: str) -> int:
    """An integer expression of + - * with the usual precedence (products first, then left to right)."""
    total = 0
    for sign, product in TERM.findall(expression):
        value = 1
        for factor in product.split("*"):
            value *= int(factor)
        total += -value if sign == "-" else value
    return total


def false_equations(completion: str) -> int:
    """How many equations in the text are false."""
    return sum(evaluate(lhs) != int(rhs) for lhs, rhs in EQUATION.findall(completion))


class FalseEquations:
    """A cost for constrained RL (`repo`'s cost_reward): C = (false integer equations in the completion) - `budget`.

    An equation is `a op b [op c ...] = v` over integers with + - * (products first): the worked steps of
    the bundled task, e.g. "3*7+1=22", "12-7=5". A right answer never needs a false one (every step of a
    reference solution, and of the sloppy teacher's, is a true equation); a model that writes "3*7+1=20"
    states something false however it then answers. C <= 0 is safe; completions with C > 0 are counted as
    `reward/<label>/violated`. Our cost for a per-response constraint, not a paper's.
    """

    class Config(PluginConfig):
        budget: float = Field(0.0, ge=0.0, description="false equations allowed before C > 0 (0: none)")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> Scores:
        costs = [float(false_equations(c)) - self.config.budget for c in completions]
        return Scores(costs, {"violated": float(sum(c > 0 for c in costs))})


@hookimpl
def register_rewards(register):
    register("false_equations", FalseEquations)
