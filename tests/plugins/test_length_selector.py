import random

import pytest
from pydantic import ValidationError

from alignflow.core.errors import DataError
from alignflow.plugins.length_selector import LengthSelector

# prompt lengths 5, 7, 2; completion lengths 3, 1, 9.
ROWS = [{"prompt": "12+3=", "completion": "abc", "id": 0},
        {"prompt": "123*45=", "completion": "x", "id": 1},
        {"prompt": "é=", "completion": "123456789", "id": 2}]


def ids(cfg: dict, rows=ROWS) -> list[int]:
    sel = LengthSelector(LengthSelector.Config.model_validate(cfg))
    return [r["id"] for r in sel(rows, random.Random(0))]


def test_bounds_are_inclusive_characters_of_the_prompt_by_default():
    assert ids({"min": 5, "max": 7}) == [0, 1]  # 5 and 7 are the bounds themselves; 2 is out
    assert ids({"min": 6}) == [1]  # no max: only 7 >= 6
    assert ids({"max": 2}) == [2]  # "é=" is 2 characters (3 UTF-8 bytes): characters are counted


def test_every_column_must_fit_unless_total():
    # each: prompt in [2, 7] holds for all; completion in [2, 7] holds for 3 only -> row 0.
    assert ids({"columns": ["prompt", "completion"], "min": 2, "max": 7}) == [0]
    # total: 5+3=8, 7+1=8, 2+9=11 -> [8, 10] keeps rows 0 and 1.
    assert ids({"columns": ["prompt", "completion"], "min": 8, "max": 10, "total": True}) == [0, 1]
    assert ids({"columns": "completion", "max": 3}) == [0, 1]  # a single column as a string


def test_missing_and_non_string_columns():
    rows = [{"prompt": "ab", "id": 0}, {"id": 1}]
    with pytest.raises(DataError, match="row 2: prompt: missing"):
        ids({}, rows)
    assert ids({"missing_ok": True}, rows) == [0]
    with pytest.raises(DataError, match="row 1: prompt: expected a string, got int"):
        ids({}, [{"prompt": 3}])


def test_config_rejects_inverted_bounds_and_no_columns():
    with pytest.raises(ValidationError, match=r"max \(3\) is below min \(4\)"):
        LengthSelector.Config(min=4, max=3)
    with pytest.raises(ValidationError):
        LengthSelector.Config(columns=[])
    assert LengthSelector.Config().columns == ["prompt"] and LengthSelector.Config().max is None


def test_selector_and_reward_may_both_be_named_length():
    # Names are unique per kind: the selector `length` sits beside the reward `length`.
    from alignflow.core.plugins import Plugins
    from alignflow.plugins import length, length_selector

    plugins = Plugins()
    plugins.add(length, "length")
    plugins.add(length_selector, "length_selector")
    assert plugins.selectors.get("length") is LengthSelector
    assert "length" in plugins.rewards
