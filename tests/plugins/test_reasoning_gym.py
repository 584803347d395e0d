"""reasoning-gym rows from a seed (the same bytes each time) and its tasks' own verifiers as a reward."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("reasoning_gym")

from alignflow.core.errors import AlignflowError  # noqa: E402
from alignflow.core.plugins import get_plugins  # noqa: E402
from alignflow.plugins.reasoning_gym import reasoning_gym, task_rows  # noqa: E402


def score(rows, completions):
    return reasoning_gym([r["prompt"] for r in rows], completions, [r["answer"] for r in rows],
                         [r["task"] for r in rows], [r["metadata"] for r in rows])


def test_rows_are_a_function_of_task_size_seed_and_config():
    a, b = task_rows("chain_sum", 20, seed=7), task_rows("chain_sum", 20, seed=7)
    assert a == b and a != task_rows("chain_sum", 20, seed=8)
    assert {"prompt", "answer", "completion", "task", "metadata"} == set(a[0])
    assert a[0]["completion"] == f"<answer>{a[0]['answer']}</answer>"
    small = task_rows("chain_sum", 20, seed=7, config={"min_digits": 1, "max_digits": 1, "max_terms": 2})
    assert all(len(json.loads(r["metadata"])["expression"].split()) == 3 for r in small)


def test_a_test_set_can_leave_out_a_training_sets_prompts():
    train = task_rows("chain_sum", 200, seed=0, config={"max_digits": 1, "max_terms": 2})
    test = task_rows("chain_sum", 50, seed=10, config={"max_digits": 1, "max_terms": 2},
                     exclude={r["prompt"] for r in train})
    assert len(test) == 50 and not {r["prompt"] for r in test} & {r["prompt"] for r in train}
    # row i comes from seed + i: without the exclusion, nearby seeds share rows
    prompts = lambda rows: [r["prompt"] for r in rows]  # noqa: E731
    assert prompts(task_rows("chain_sum", 5, seed=1)) == prompts(task_rows("chain_sum", 6, seed=0)[1:])


def test_the_tasks_own_verifier_scores_the_answer_tag():
    rows = task_rows("chain_sum", 3, seed=1) + task_rows("leg_counting", 2, seed=1)
    right = [f"I think <answer>{r['answer']}</answer>" for r in rows]
    assert score(rows, right) == [1.0] * 5
    assert score(rows, ["<answer>nope</answer>"] * 5) == [0.0] * 5
    assert score(rows[:1], [rows[0]["answer"]]) == [1.0]  # no tag: the whole completion is the answer


def test_an_unknown_task_lists_the_known_ones():
    with pytest.raises(AlignflowError, match="reasoning-gym task 'chain_summ'.*chain_sum"):
        task_rows("chain_summ", 3, seed=0)


def test_registered_as_a_reward():
    assert get_plugins().rewards.get("reasoning_gym") is reasoning_gym


@pytest.mark.system
def test_the_cli_writes_the_same_bytes_for_the_same_command(tmp_path):
    cmd = [sys.executable, "-m", "alignflow.flows.cli", "data", "reasoning-gym", "basic_arithmetic", "--size", "30",
           "--seed", "4", "--config", "max_terms=3"]
    for out in ("a.jsonl", "b.jsonl"):
        subprocess.run(cmd + ["--out", str(tmp_path / out)], check=True, capture_output=True)
    a = (tmp_path / "a.jsonl").read_bytes()
    assert a == (tmp_path / "b.jsonl").read_bytes() and len(a.splitlines()) == 30
    assert json.loads(a.splitlines()[0])["task"] == "basic_arithmetic"
