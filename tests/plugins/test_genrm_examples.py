"""genrm_examples: verifier-labelled samples become GenRM rows, the rationale written by the task's checker."""

import random

import pytest
from pydantic import ValidationError

from alignflow.plugins.genrm_examples import GenRMExamples, recheck

Q = " Is the answer correct (Yes/No)?"
RIGHT = "<think>7+8=15 3+4+1=8</think><answer>85</answer>"
NO_CARRY = "<think>7+8=15 3+4=7</think><answer>75</answer>"  # the sloppy teacher's dropped carry
ROWS = [{"prompt": "37+48=", "completion": RIGHT, "correct": True},
        {"prompt": "37+48=", "completion": NO_CARRY, "correct": False},
        {"prompt": "52-17=", "completion": "<think>12-7=5 5-1=4</think><answer>45</answer>", "correct": False},
        {"prompt": "47*6=", "completion": "<think>7*6=42</think><answer>282</answer>", "correct": True}]


@pytest.mark.parametrize(("prompt", "completion", "rationale"), [
    ("37+48=", RIGHT, "7+8=15 ok; 3+4+1=8 ok; answer 85 ok."),
    ("37+48=", NO_CARRY, "7+8=15 ok; 3+4=7 wrong 3+4+1=8; answer 75 wrong 85."),
    ("52-17=", "<think>12-7=5 5-1=4</think><answer>45</answer>", "12-7=5 ok; 5-1=4 wrong 5-1-1=3; answer 45 wrong 35."),
    ("47*6=", "<think>7*6=42</think><answer>282</answer>", "7*6=42 ok; missing 4*6+4=28; answer 282 ok."),
    ("3+4=", "<think>3+4=7 0+0=0</think><answer>7</answer>", "3+4=7 ok; 0+0=0 extra; answer 7 ok."),
    ("3+4=", "7", "missing 3+4=7; answer none wrong 7."),  # no steps, no answer tags
])
def test_recheck_compares_each_step_with_the_exact_one_then_the_answer(prompt, completion, rationale):
    assert recheck(prompt, completion) == rationale


def test_rows_become_question_rationale_and_verdict():
    out = GenRMExamples(GenRMExamples.Config(balance=False))(ROWS, random.Random(0))
    assert out[:2] == [
        {"prompt": "37+48=" + RIGHT + Q, "completion": " 7+8=15 ok; 3+4+1=8 ok; answer 85 ok. Yes"},
        {"prompt": "37+48=" + NO_CARRY + Q, "completion": " 7+8=15 ok; 3+4=7 wrong 3+4+1=8; answer 75 wrong 85. No"}]
    assert [r["completion"][-4:] for r in out] == [" Yes", ". No", ". No", " Yes"]


def test_direct_rows_hold_the_verdict_alone_and_solutions_add_sft_rows():
    out = GenRMExamples(GenRMExamples.Config(rationale="none", balance=False, solutions=True))(ROWS, random.Random(0))
    assert [r["completion"] for r in out[:4]] == [" Yes", " No", " No", " Yes"]
    assert out[4:] == [{"prompt": "37+48=", "completion": RIGHT},
                       {"prompt": "47*6=", "completion": ROWS[3]["completion"]}]


def test_balance_keeps_every_minority_row_and_a_seeded_draw_of_the_rest():
    rows = ROWS + [{"prompt": "1+1=", "completion": "<answer>3</answer>", "correct": False}]  # 2 yes, 3 no
    outs = [GenRMExamples(GenRMExamples.Config(rationale="none"))(rows, random.Random(s)) for s in range(30)]
    assert all(sorted(r["completion"] for r in out) == [" No", " No", " Yes", " Yes"] for out in outs)
    assert all(out[0]["prompt"] == "37+48=" + RIGHT + Q for out in outs)  # input order kept
    assert len({tuple(r["prompt"] for r in out) for out in outs}) == 3  # which 2 of the 3 "no" rows: drawn


def test_bad_config_and_rows_name_the_problem():
    with pytest.raises(ValidationError, match="must use"):
        GenRMExamples.Config(template="{prompt}{answer}?")
    with pytest.raises(ValidationError, match="different"):
        GenRMExamples.Config(yes=" Yes", no=" Yes")
    with pytest.raises(ValueError, match="row 1 has no correct"):
        GenRMExamples(GenRMExamples.Config())([ROWS[0], {"prompt": "1+1=", "completion": "2"}], random.Random(0))
    with pytest.raises(ValueError, match="row 0, field prompt: prompt 'hello' is not an arithmetic"):
        GenRMExamples(GenRMExamples.Config())([{"prompt": "hello", "completion": "2", "correct": True}],
                                              random.Random(0))
