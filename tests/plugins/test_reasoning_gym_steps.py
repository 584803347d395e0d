"""Worked step-wise solutions of reasoning-gym tasks: exact texts, the sloppy teacher's slips, the tasks' own
verifiers, and the CLI's bytes."""

import json
import random
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")

from alignflow.core.errors import AlignflowError  # noqa: E402
from alignflow.core.train.steps import split_steps  # noqa: E402
from alignflow.plugins.reasoning_gym import reasoning_gym  # noqa: E402
from alignflow.plugins.reasoning_gym_steps import (NOISE, SEPARATOR, WRITERS, render, sloppy_fault,  # noqa: E402
                                                   step_rows, worked)

EXAMPLES = [  # task, metadata, clean steps, answer
    ("chain_sum", {"expression": "0 - 4 - 8"}, ["0-4=-4", "-4-8=-12"], "-12"),
    ("chain_sum", {"expression": "7 + 5"}, ["7+5=12"], "12"),
    ("spell_backward", {"word": "neon"}, ["n", "o", "e", "n"], "noen"),
    ("letter_counting", {"target_letter": "n", "span": ["hundred", "thousaNd"]}, ["hundred:1", "thousaNd:1"], "2"),
    ("count_bits", {"number": 50}, ["50-32=18", "18-16=2", "2-2=0"], "3"),
    ("count_bits", {"number": 1}, ["1-1=0"], "1"),
    ("gcd", {"numbers": [26, 59]}, ["59%26=7", "26%7=5", "7%5=2", "5%2=1", "2%1=0"], "1"),
    ("gcd", {"numbers": [6, 6]}, ["6%6=0"], "6"),
]


def score(rows, completions):
    return reasoning_gym([r["prompt"] for r in rows], completions, [r["answer"] for r in rows],
                         [r["task"] for r in rows], [r["metadata"] for r in rows])


@pytest.mark.parametrize(("task", "meta", "steps", "answer"), EXAMPLES)
def test_the_clean_teacher_writes_each_step(task, meta, steps, answer):
    assert worked(task, meta) == (steps, answer)
    assert worked(task, json.dumps(meta)) == (steps, answer)  # rows keep metadata as JSON text


def test_a_rendered_solution_splits_back_into_its_steps():
    text = render(["0-4=-4", "-4-8=-12"], "-12")
    assert text == "<think>0-4=-4 -4-8=-12</think><answer>-12</answer>"
    assert split_steps(text, SEPARATOR) == ["<think>0-4=-4", "-4-8=-12</think><answer>-12</answer>"]


@pytest.mark.parametrize(("task", "meta", "fault", "steps", "answer"), [
    # a slipped result is carried on to the answer
    ("chain_sum", {"expression": "0 - 4 - 8"}, (0, 1), ["0-4=-3", "-3-8=-11"], "-11"),
    ("chain_sum", {"expression": "0 - 4 - 8"}, (1, -1), ["0-4=-4", "-4-8=-13"], "-13"),
    ("spell_backward", {"word": "neon"}, (1, 1), ["n", "e", "n"], "nen"),  # a letter skipped
    ("letter_counting", {"target_letter": "n", "span": ["hundred", "the"]}, (1, -1), ["hundred:1", "the:1"], "2"),
    ("letter_counting", {"target_letter": "n", "span": ["hundred", "the"]}, (0, -1), ["hundred:0", "the:0"], "0"),
    # 18 off by one, then the largest powers of 17: one step more than 50 has 1 bits
    ("count_bits", {"number": 50}, (1, 1), ["50-32=18", "18-16=3", "3-2=1", "1-1=0"], "4"),
    ("gcd", {"numbers": [26, 59]}, (0, -1), ["59%26=6", "26%6=2", "6%2=0"], "2"),
])
def test_a_slip_is_followed_through(task, meta, fault, steps, answer):
    assert worked(task, meta, fault) == (steps, answer)


def test_the_sloppy_teacher_slips_in_some_solutions_at_a_fixed_seed():
    sloppy = step_rows(["chain_sum", "count_bits"], 3, seed=0, teacher="sloppy")
    clean = {r["prompt"]: r["completion"] for r in step_rows(["chain_sum", "count_bits"], 3, seed=0)}
    def of(end: str) -> str:
        return next(r["completion"] for r in sloppy if r["prompt"].endswith(end))

    assert of("problem: 1 + 5 =") == "<think>1+5=7</think><answer>7</answer>"  # the answer is 6
    assert of("the number 490?") == ("<think>490-256=235 235-128=107 107-64=43 43-32=11 11-8=3 3-2=1 1-1=0</think>"
                                        "<answer>7</answer>")  # 6 bits
    assert sum(r["completion"] != clean[r["prompt"]] for r in sloppy) == 4
    assert {r["prompt"] for r in sloppy} == set(clean)


def test_the_sloppy_teacher_slips_in_about_noise_of_its_solutions():
    rng = random.Random(1)
    faults = [sloppy_fault("count_bits", {"number": 50}, rng) for _ in range(2000)]
    slipped = [f for f in faults if f is not None]
    assert abs(len(slipped) / 2000 - NOISE) < 0.04
    assert {f[0] for f in slipped} == {0, 1, 2} and {f[1] for f in slipped} == {-1, 1}


@pytest.mark.parametrize("task", sorted(WRITERS))
def test_clean_solutions_satisfy_the_tasks_own_verifier(task):
    rows = step_rows([task], 50, seed=3)
    assert len(rows) == 50 and all(r["task"] == task for r in rows)
    assert score(rows, [r["completion"] for r in rows]) == [1.0] * 50
    sloppy = step_rows([task], 50, seed=3, teacher="sloppy")
    wrong = sum(v < 1 for v in score(sloppy, [r["completion"] for r in sloppy]))
    assert 5 <= wrong <= 40  # some slips change the answer, not all solutions slip


def test_rows_mix_the_tasks_in_a_seeded_order():
    rows = step_rows(["chain_sum", "spell_backward"], 20, seed=0)
    assert rows == step_rows(["chain_sum", "spell_backward"], 20, seed=0)
    tasks = [r["task"] for r in rows]
    assert tasks.count("chain_sum") == 20 and tasks[:20] != ["chain_sum"] * 20


def test_bad_input_names_the_task_and_field():
    with pytest.raises(AlignflowError, match="no worked solutions for reasoning-gym task 'chain_summ'"):
        worked("chain_summ", {})
    with pytest.raises(AlignflowError, match="'spell_backward': metadata missing or malformed: 'word'"):
        worked("spell_backward", {"words": "neon"})
    with pytest.raises(AlignflowError, match="'chain_sum': metadata missing or malformed.*'3 \\* 4'"):
        worked("chain_sum", {"expression": "3 * 4"})
    with pytest.raises(AlignflowError, match="tasks leg_counting: expected some of"):
        step_rows(["chain_sum", "leg_counting"], 2, seed=0)
    with pytest.raises(AlignflowError, match="teacher 'noisy'"):
        step_rows(["chain_sum"], 2, seed=0, teacher="noisy")


@pytest.mark.system
def test_the_cli_writes_the_same_bytes_for_the_same_command(tmp_path):
    cmd = [sys.executable, "-m", "alignflow.flows.cli", "data", "reasoning-gym-steps", "--tasks", "gcd,spell_backward",
           "--size", "20", "--seed", "4", "--teacher", "sloppy"]
    for out in ("a.jsonl", "b.jsonl"):
        subprocess.run(cmd + ["--out", str(tmp_path / out)], check=True, capture_output=True)
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes() and len(a.splitlines()) == 40
    rows = [json.loads(line) for line in a.splitlines()]
    assert {r["task"] for r in rows} == {"gcd", "spell_backward"}
    assert rows == step_rows(["gcd", "spell_backward"], 20, seed=4, teacher="sloppy")
    subprocess.run(cmd + ["--columns", "prompt,completion", "--out", str(tmp_path / "c.jsonl")], check=True,
                   capture_output=True)
    assert [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()] == [
        {"prompt": r["prompt"], "completion": r["completion"]} for r in rows]
    done = subprocess.run(cmd + ["--columns", "prompt,solution", "--out", str(tmp_path / "d.jsonl")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "--columns: solution not among the rows'" in done.stdout + done.stderr
