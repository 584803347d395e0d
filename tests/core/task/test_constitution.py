"""Constitution files: principles one per line, comments and blanks skipped, bad files named; seeded draws."""

import random

import pytest

from alignflow.core.task.constitution import constitution_problems, draw_principles, read_principles
from alignflow.core.errors import DataError


def test_principles_are_the_stripped_non_comment_lines_in_order(tmp_path):
    path = tmp_path / "c.txt"
    path.write_text("# arithmetic\n\n  Check every carry.  \n#Check nothing.\nCheck every borrow.\n   \n")
    assert read_principles(path) == ["Check every carry.", "Check every borrow."]
    assert constitution_problems(path) == []


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n#another\n"])
def test_an_empty_constitution_is_an_error_naming_the_file(tmp_path, text):
    path = tmp_path / "empty.txt"
    path.write_text(text)
    with pytest.raises(DataError, match=f"{path}: empty constitution: no principles"):
        read_principles(path)
    assert constitution_problems(path) == [f"{path}: empty constitution: no principles (expected a text file, "
                                           "one principle per non-empty line; lines starting with '#' are comments)"]


def test_a_missing_or_binary_constitution_is_an_error_naming_the_file(tmp_path):
    with pytest.raises(DataError, match=f"{tmp_path / 'nope.txt'}: no such constitution file"):
        read_principles(tmp_path / "nope.txt")
    with pytest.raises(DataError, match=f"{tmp_path}: no such constitution file"):
        read_principles(tmp_path)  # a folder
    (tmp_path / "bin.txt").write_bytes(b"Check\xff\xfe")
    assert "bin.txt: the constitution is not UTF-8 text (byte 5)" in constitution_problems(tmp_path / "bin.txt")[0]


def test_draws_are_seeded_per_answer_and_round_and_cover_the_constitution():
    principles = ["a", "b", "c"]
    drawn = draw_principles(principles, answers=4, rounds=2, seed=7)
    assert len(drawn) == 4 and all(len(d) == 2 for d in drawn)
    # one Random(seed), answer by answer, round by round
    rng = random.Random(7)
    assert drawn == [[rng.choice(principles), rng.choice(principles)] for _ in range(4)]
    assert draw_principles(principles, 4, 2, seed=7) == drawn  # a rerun draws the same
    many = [p for d in draw_principles(principles, 300, 1, seed=0) for p in d]
    assert draw_principles(principles, 300, 1, seed=1) != draw_principles(principles, 300, 1, seed=0)
    assert all(80 < many.count(p) < 120 for p in principles)  # uniform: 100 each expected, sd ~8
