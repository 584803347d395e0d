"""judge_examples: scored samples become balanced judge-training rows."""

import random

import pytest

from alignflow.plugins.judge_examples import JudgeExamples

ROWS = [{"prompt": "1+1=", "completion": "2", "correct": True, "rewards": {"math_accuracy": 1.0}},
        {"prompt": "2+2=", "completion": "5", "correct": False, "rewards": {"math_accuracy": 0.0}},
        {"prompt": "3+3=", "completion": "7", "correct": False, "rewards": {"math_accuracy": 0.0}},
        {"prompt": "4+4=", "completion": "9", "correct": False, "rewards": {"math_accuracy": 0.0}}]


def test_rows_become_template_and_verdict():
    out = JudgeExamples(JudgeExamples.Config(balance=False, answers=False))(ROWS, random.Random(0))
    assert out == [{"prompt": "1+1=2?", "completion": "Y"}, {"prompt": "2+2=5?", "completion": "N"},
                   {"prompt": "3+3=7?", "completion": "N"}, {"prompt": "4+4=9?", "completion": "N"}]


def test_balance_keeps_one_of_each_verdict_per_minority_row_in_input_order():
    outs = [JudgeExamples(JudgeExamples.Config(answers=False))(ROWS, random.Random(seed)) for seed in range(20)]
    assert all([r["completion"] for r in out] .count("N") == 1 and out[0] == {"prompt": "1+1=2?", "completion": "Y"}
               for out in outs)
    assert len({out[1]["prompt"] for out in outs}) == 3  # the kept "N" row is a seeded draw among the three


def test_bad_template_and_rows_name_the_problem():
    with pytest.raises(ValueError, match="must use"):
        JudgeExamples(JudgeExamples.Config(template="{answer}?"))(ROWS, random.Random(0))
    with pytest.raises(ValueError, match="row 1 has no correct"):
        JudgeExamples()([ROWS[0], {"prompt": "x", "completion": "y"}], random.Random(0))


def test_answers_keeps_each_correct_sample_as_an_sft_row_after_the_judge_rows():
    out = JudgeExamples()(ROWS, random.Random(0))
    assert len(out) == 3 and out[-1] == {"prompt": "1+1=", "completion": "2"}  # 1 Y + 1 N judge rows, 1 answer
