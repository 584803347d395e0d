from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor

import pytest

from alignflow.plugins.math_accuracy import extract_answer, is_equivalent, math_accuracy


@pytest.mark.parametrize(
    ("completion", "expected"),
    [
        ("<think>x</think><answer> 42 </answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        (r"so \boxed{1} or rather \boxed{\frac{1}{2}}.", r"\frac{1}{2}"),
        (r"<answer>7</answer> \boxed{8}", "7"),  # the tag wins over a box
        (r"\boxed{\frac{1}{2}", None),  # unbalanced
        ("no answer here", None),
    ],
)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(
    ("pred", "gold", "same"),
    [
        ("0.5", r"\frac{1}{2}", True),
        ("1/2", "0.5", True),
        (r"\frac{1}{2}", "1/2", True),
        ("$42$", " 42. ", True),
        (r"\sqrt{2}", "2^{1/2}", True),
        ("1+x", "x+1", True),
        ("3", "4", False),
        ("", "4", False),
        ("abc", "4", False),
    ],
)
def test_is_equivalent(pred, gold, same):
    assert is_equivalent(pred, gold) is same


def test_math_accuracy_scores_batch_and_ignores_other_columns():
    completions = ["<answer>0.5</answer>", r"\boxed{3}", "I don't know", "<answer>2</answer>"]
    answers = [r"\frac{1}{2}", "4", "1", None]
    scores = math_accuracy(["q"] * 4, completions, answer=answers, tests=[None] * 4)
    assert scores == [1.0, 0.0, 0.0, None]


def _score_one(pair):
    return math_accuracy(["q"], [pair[0]], answer=[pair[1]])[0]


PAIRS = [(r"<answer>\frac{1}{2}</answer>", "0.5"), ("<answer>1/3</answer>", "0.25")]


def test_math_accuracy_off_the_main_thread():
    # math-verify's timeout uses SIGALRM, which raises off the main thread unless disabled.
    with ThreadPoolExecutor(2) as pool:
        assert list(pool.map(_score_one, PAIRS)) == [1.0, 0.0]


@pytest.mark.system
def test_math_accuracy_in_a_process_pool():
    with ProcessPoolExecutor(2) as pool:
        assert list(pool.map(_score_one, PAIRS)) == [1.0, 0.0]


def math_verify_says(pred: str, gold: str) -> bool:
    from math_verify import parse, verify

    return bool(verify(parse(f"${gold}$"), parse(f"${pred}$")))


def test_integers_compare_as_math_verify_compares_them():
    """The fast path for two plain integers gives math-verify's own verdict, on the task's shapes of
    answer (every pair of 0..120 and signs) and on the odd ones (leading zeros, minus zero, long)."""
    numbers = [str(i) for i in range(121)] + ["-7", "-0", "007", "0012", "10000000000000000000001"]
    pairs = [(a, b) for a in numbers for b in numbers[::7]] + [("007", "7"), ("-0", "0"), ("0012", "12"),
                                                               ("10000000000000000000001", "1e22")]
    for pred, gold in pairs:
        assert is_equivalent(pred, gold) == math_verify_says(pred, gold), (pred, gold)
