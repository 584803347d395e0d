import hashlib
import json
import random
import re

import pytest

from alignflow.core.task import arithmetic as task
from alignflow.core.task.arithmetic import Problem, corrupt, extract_answer, generate, render, verify, work


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    paths = task.write_datasets(tmp_path_factory.mktemp("task"), seed=0)
    rows = {name: [json.loads(line) for line in p.read_text().splitlines()] for name, p in paths.items()}
    return paths, rows


def _step_ok(step: str) -> bool:
    # The notation is valid Python arithmetic: "12-7=5", "9-4-1=4", "8*6+4=52".
    lhs, rhs = step.split("=")
    return eval(lhs) == int(rhs)


def test_worked_solutions_are_exact_for_whole_small_ranges():
    cases = [(a, "+", b) for a in range(100) for b in range(100)]
    cases += [(a, "-", b) for a in range(100) for b in range(a + 1)]
    cases += [(a, "*", b) for a in range(10, 100) for b in range(2, 10)]
    for a, op, b in cases:
        steps, answer = work(a, op, b)
        assert answer == str(task.evaluate(a, op, b)), (a, op, b)
        assert all(_step_ok(s) for s in steps), (a, op, b, steps)


def test_notation_examples():
    assert Problem(37, "+", 48).completion() == "<think>7+8=15 3+4+1=8</think><answer>85</answer>"
    assert Problem(52, "-", 17).steps() == ["12-7=5", "5-1-1=3"]
    assert Problem(100, "-", 1).steps() == ["10-1=9", "10-0-1=9", "1-0-1=0"]
    assert Problem(47, "*", 6).completion() == "<think>7*6=42 4*6+4=28</think><answer>282</answer>"


def test_write_datasets_is_byte_identical_and_seed_dependent(datasets, tmp_path):
    paths, _ = datasets
    again = task.write_datasets(tmp_path / "again", seed=0)
    other = task.write_datasets(tmp_path / "other", seed=1)
    digest = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    assert {n: digest(p) for n, p in paths.items()} == {n: digest(p) for n, p in again.items()}
    assert digest(paths["sft"]) != digest(other["sft"])
    assert set(paths) == {"sft", "sft_noisy", "rl", "pairs", "unpaired", "steps", "test", *task.SAFE}
    assert sum(p.stat().st_size for p in paths.values()) < 3_000_000
    line = paths["sft"].read_text().splitlines()[0]
    assert line == json.dumps(json.loads(line), sort_keys=True)


def test_sizes_and_level_mix(datasets):
    _, rows = datasets
    assert {n: len(r) for n, r in rows.items()} == {**task.SIZES, **{n: task.SIZES[b] for n, b in task.SAFE.items()}}
    levels = [r["level"] for r in rows["test"]]
    assert {lv: levels.count(lv) for lv in task.LEVELS} == {1: 150, 2: 150, 3: 75, 4: 125}
    for name in ("sft", "sft_noisy", "rl", "test"):
        assert len({r["prompt"] for r in rows[name]}) == len(rows[name])


def test_draw_names_the_level_it_cannot_fill():
    # 6000 problems at the usual mix want 900 of level 3, which has 720: an error, not an endless loop.
    with pytest.raises(ValueError, match="level 3: cannot draw 180 more"):
        task.draw(6000, random.Random(0))


def test_test_prompts_are_held_out(datasets):
    _, rows = datasets
    test = {r["prompt"] for r in rows["test"]}
    for name, rs in rows.items():
        if name not in ("test", "safe_test"):
            assert not test & {r["prompt"].lstrip(task.RESTRICTED) for r in rs}, name


def test_safe_files_restrict_a_share_of_their_base_files_prompts(datasets):
    _, rows = datasets
    for name, base in task.SAFE.items():
        restricted = [r["restricted"] for r in rows[name]]
        # the same problems in the same order, SAFE_SHARE of them marked "!" (binomial: within 4 sd)
        assert [r["prompt"].lstrip("!") for r in rows[name]] == [r["prompt"] for r in rows[base]], name
        assert all(r["prompt"].startswith("!") == r["restricted"] for r in rows[name]), name
        share, n = sum(restricted) / len(restricted), len(restricted)
        assert abs(share - task.SAFE_SHARE) < 4 * (task.SAFE_SHARE * (1 - task.SAFE_SHARE) / n) ** 0.5, name
        if name != "safe_sft":  # the verifier's rows keep their answers, and "!" prompts parse
            assert [r["answer"] for r in rows[name]] == [r["answer"] for r in rows[base]]
            assert all(task.verify(r["prompt"], r["answer"]) for r in rows[name])
    restricted = [r for r in rows["safe_sft"] if r["restricted"]]
    leaked = [r for r in restricted if "=" in r["completion"]]
    assert abs(len(leaked) / len(restricted) - task.SAFE_LEAK) < 0.05
    for r in restricted:  # a complying demonstration is the right answer alone
        if r not in leaked:
            assert r["completion"] == task.render([], str(task.evaluate(*task.parse(r["prompt"]))))


def test_every_training_solution_is_correct(datasets):
    _, rows = datasets
    for r in rows["sft"] + [{"prompt": r["prompt"], "completion": r["chosen"]} for r in rows["pairs"]]:
        assert verify(r["prompt"], extract_answer(r["completion"])), r
        think = re.search(r"<think>(.*)</think>", r["completion"])[1]
        assert all(_step_ok(s) for s in think.split(" ")), r
    for r in rows["rl"] + rows["test"]:
        assert verify(r["prompt"], r["answer"])


def test_corrupted_solutions_are_wrong(datasets):
    _, rows = datasets
    for r in rows["pairs"]:
        assert not verify(r["prompt"], extract_answer(r["rejected"])), r
    labels = [r["label"] for r in rows["unpaired"]]
    assert 0.45 < sum(labels) / len(labels) < 0.55
    for r in rows["unpaired"]:
        assert verify(r["prompt"], extract_answer(r["completion"])) == r["label"], r


def test_step_labels_mark_first_wrong_step_and_after(datasets):
    _, rows = datasets
    n_bad = 0
    for r in rows["steps"]:
        a, op, b = task.parse(r["prompt"])
        good = work(a, op, b)[0]
        labels = r["step_labels"]
        assert len(labels) == len(r["steps"]) == len(good)
        first_bad = next((i for i, ok in enumerate(labels) if not ok), len(labels))
        assert labels == [i < first_bad for i in range(len(labels))]
        # Steps agree with the correct solution exactly up to the first bad one, which differs.
        assert r["steps"][:first_bad] == good[:first_bad]
        if first_bad < len(labels):
            n_bad += 1
            assert r["steps"][first_bad] != good[first_bad]
    assert n_bad == len(rows["steps"]) // 2


def test_levels_are_honoured():
    rng = random.Random(0)
    for _ in range(300):
        p = generate(1, rng)
        assert p.op in "+-" and 0 <= p.b <= p.a <= 99 or p.op == "+" and max(p.a, p.b) <= 99
        p = generate(2, rng)
        assert p.op in "+-" and 10 <= min(p.a, p.b) and max(p.a, p.b) <= 999
        assert any(re.fullmatch(r"1?\d[+-]\d[+-]1=\d+", s) for s in p.steps()), p
        p = generate(3, rng)
        assert p.op == "*" and 10 <= p.a <= 99 and 2 <= p.b <= 9
        p = generate(4, rng)
        assert p.op == "*" and 100 <= p.a <= 999 and 2 <= p.b <= 9
    with pytest.raises(ValueError, match="unknown level 7"):
        generate(7, rng)


def test_completions_stay_short():
    rng = random.Random(1)
    for level in task.LEVELS:
        longest = max(len(generate(level, rng).completion()) for _ in range(200))
        # Chars; the four tags are single tokens, so the token count is this minus 28.
        assert longest <= {1: 50, 2: 60, 3: 50, 4: 60}[level], (level, longest)


def test_corrupt_gives_wrong_answer_and_first_bad_index():
    rng = random.Random(3)
    for level in task.LEVELS:
        for _ in range(100):
            p = generate(level, rng)
            steps, wrong, first_bad = corrupt(p, rng)
            assert wrong != p.answer and not verify(p.prompt, wrong)
            assert steps[:first_bad] == p.steps()[:first_bad] != steps


def test_verify_and_extract_answer():
    assert verify("37+48=", "85") and verify("37+48=", " 85 ")
    assert not verify("37+48=", "84") and not verify("37+48=", None) and not verify("37+48=", "8 5")
    assert not verify("not a problem", "1")
    assert extract_answer(render(["7+8=15"], "15")) == "15"
    assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
    assert extract_answer("<answer>85") is None


def test_carry_columns():
    assert Problem(37, "+", 48).carry_columns() == [1]  # 7+8=15 3+4+1=8
    assert Problem(52, "-", 17).carry_columns() == [1]  # 12-7=5 5-1-1=3
    assert Problem(100, "-", 1).carry_columns() == [1, 2]
    assert Problem(47, "*", 6).carry_columns() == [1]  # 7*6=42 4*6+4=28
    assert Problem(21, "*", 3).carry_columns() == []
    assert Problem(12, "+", 3).carry_columns() == []


def test_sloppy_teacher_drops_the_first_carry_in_its_share_of_solutions(datasets):
    _, rows = datasets
    with_carry = dropped = 0
    for r in rows["sft_noisy"]:
        p = Problem(*task.parse(r["prompt"]))
        if not p.carry_columns():
            assert r["completion"] == p.completion(), r
            continue
        with_carry += 1
        if r["completion"] != p.completion():
            dropped += 1
            # 37+48: "7+8=15 3+4=7" -> 75: the carry into the first carry column is gone, the rest follows.
            steps, answer = work(p.a, p.op, p.b, (p.carry_columns()[0], "carry"))
            assert r["completion"] == render(steps, answer), r
            assert not verify(r["prompt"], answer)
    assert with_carry > 2000
    assert abs(dropped / with_carry - task.NOISE) < 0.03
    assert work(37, "+", 48, (1, "carry")) == (["7+8=15", "3+4=7"], "75")
