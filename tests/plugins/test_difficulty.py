import random

import pytest
from pydantic import ValidationError

from alignflow.core.errors import DataError
from alignflow.plugins.difficulty import Difficulty


def run(cfg: dict, rows: list[dict]) -> list[dict]:
    return Difficulty(Difficulty.Config.model_validate(cfg))(rows, random.Random(0))


RATES = [{"pass_rate": r, "id": i} for i, r in enumerate([0.0, 0.25, 1.0, 0.5, 0.75])]


def test_default_drops_prompts_always_or_never_solved():
    assert [r["id"] for r in run({}, RATES)] == [1, 3, 4]


def test_bounds_strict_and_inclusive():
    # strict (0.25, 0.75): only 0.5.
    assert [r["id"] for r in run({"min_pass": 0.25, "max_pass": 0.75}, RATES)] == [3]
    # inclusive [0.25, 0.75]: 0.25, 0.5, 0.75.
    assert [r["id"] for r in run({"min_pass": 0.25, "max_pass": 0.75, "strict": False}, RATES)] == [1, 3, 4]
    # inclusive [0, 0]: the never-solved prompt only.
    assert [r["id"] for r in run({"max_pass": 0.0, "strict": False}, RATES)] == [0]


def test_group_mean_over_evaluate_samples():
    # evaluate's samples: one row per completion, `correct` a bool.
    samples = [{"prompt": "a", "correct": True}, {"prompt": "b", "correct": False},
               {"prompt": "a", "correct": False}, {"prompt": "b", "correct": False},
               {"prompt": "c", "correct": True}, {"prompt": "a", "correct": True},
               {"prompt": "c", "correct": True}, {"prompt": "b", "correct": False}]
    # a: (1+0+1)/3 = 2/3; b: 0/3 = 0; c: 2/2 = 1 -> only a is strictly inside (0, 1).
    kept = run({"column": "correct", "group_by": "prompt"}, samples)
    assert [r["prompt"] for r in kept] == ["a", "a", "a"]
    assert [r["pass_rate"] for r in kept] == [2 / 3] * 3
    assert "pass_rate" not in samples[0]  # the input rows are not mutated
    # LIMO-style inclusive [1/2, 1]: a (2/3) and c (1), in input order.
    kept = run({"column": "correct", "group_by": "prompt", "min_pass": 0.5, "strict": False}, samples)
    assert [r["prompt"] for r in kept] == ["a", "a", "c", "a", "c"]


def test_bad_values_name_the_row():
    with pytest.raises(DataError, match="row 2: pass_rate: missing"):
        run({}, [{"pass_rate": 0.5}, {}])
    with pytest.raises(DataError, match="row 1: pass_rate: expected a number, got '0.5'"):
        run({}, [{"pass_rate": "0.5"}])
    with pytest.raises(DataError, match="row 1: prompt: missing"):
        run({"column": "correct", "group_by": "prompt"}, [{"correct": True}])


def test_config_bounds():
    with pytest.raises(ValidationError, match=r"max_pass \(0.2\) is below min_pass \(0.5\)"):
        Difficulty.Config(min_pass=0.5, max_pass=0.2)
    with pytest.raises(ValidationError):
        Difficulty.Config(max_pass=1.5)
