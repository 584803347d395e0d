"""false_equations cost: C = false integer equations in the completion - budget, violations counted beside it."""

import random

import pytest
from pydantic import ValidationError

from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import RewardSet
from alignflow.core.task.arithmetic import draw, render, sloppy
from alignflow.plugins.false_equations import FalseEquations, evaluate, false_equations

COMPLETIONS = [
    # the reference solution of 112+489=: 2+9=11, 1+8+1=10, 1+4+1=6, all true
    "<think>2+9=11 1+8+1=10 1+4+1=6</think><answer>601</answer>",
    # cold-start samples: 7-8 = -1, not 1 (one false); 13-4=9 and 4-0-1=3 true
    "<think>7-8=1 13-4=9 4-0-1=3</think><answer>391</answer>",
    # 4*7=28 true, 2*7+2 = 14+2 = 16 true, 3*7+1 = 21+1 = 22, not 20 (one false)
    "<think>4*7=28 2*7+2=16 3*7+1=20</think><answer>2068</answer>",
    # 6*3=18 true twice, 1*3+1 = 4, not 5; 2+2=5 in the answer is an equation too: two false
    "<think>6*3=18 6*3=18 1*3+1=5</think><answer>2+2=5</answer>",
]


def test_products_before_sums_and_borrows_as_integers():
    # 3*9+3 = 27+3 = 30; 3+9*3 = 3+27 = 30 (read left to right, (3+9)*3 = 36)
    assert evaluate("3*9+3") == 30 and evaluate("3+9*3") == 30
    # 12-7-1: a borrow "1 lent to 2, 1 paid back" is 12-7-1 = 4; 2-3*4+10 = 2-12+10 = 0
    assert evaluate("12-7-1") == 4 and evaluate("2-3*4+10") == 0
    assert false_equations("3+9*3=30 12-7=5 7-8=-1") == 0  # all true, a signed right side included
    assert false_equations("3+9*3=36") == 1  # true only if read left to right
    # a left side right after a digit or an operator is not read from inside: "-3+5=2" is skipped, not 3+5=2
    assert false_equations("-3+5=2 x5=5 8=9") == 0  # no operator on the left: not an equation to check


def test_cost_is_false_equations_minus_budget():
    scores = FalseEquations()(["p"] * 4, COMPLETIONS)
    assert list(scores) == [0.0, 1.0, 1.0, 2.0] and scores.counts == {"violated": 3.0}
    # budget 1: C = count - 1, a violation only above one false equation
    scores = FalseEquations(FalseEquations.Config(budget=1))(["p"] * 4, COMPLETIONS)
    assert list(scores) == [-1.0, 0.0, 0.0, 1.0] and scores.counts == {"violated": 1.0}
    with pytest.raises(ValidationError, match="budget"):
        FalseEquations.Config(budget=-1)


def test_no_teacher_solution_states_a_false_equation():
    # The constraint must be one a right answer can always meet, and not the noise the verifier already removes:
    # every step of the reference and of the sloppy teacher (a dropped carry is left out, not miscounted) is true.
    rng = random.Random(0)
    problems = draw(400, rng)
    assert sum(false_equations(p.completion()) for p in problems) == 0
    assert sum(false_equations(render(*sloppy(p, rng))) for p in problems) == 0


def test_as_a_weight_zero_reward_it_is_measured_not_added():
    rewards = RewardSet.from_refs([("math_accuracy", 1.0), ("false_equations", 0.0)], get_plugins())
    out = rewards(["112+489=", "437-48=", "324*7=", "p"], COMPLETIONS, answer=["601", "389", "2268", "4"])
    assert out.total == [1.0, 0.0, 0.0, 0.0]  # math_accuracy alone
    assert out.values["false_equations"] == [0.0, 1.0, 1.0, 2.0]
    assert out.metrics["reward/false_equations/violated"] == 3.0
