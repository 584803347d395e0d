import random

import pytest
from pydantic import ValidationError

from alignflow.core.errors import DataError
from alignflow.plugins.column_filter import ColumnFilter

ROWS = [{"level": 1, "id": 0}, {"level": 2, "id": 1}, {"level": 3, "id": 2}, {"level": 2, "id": 3}]


def ids(cfg: dict) -> list[int]:
    return [r["id"] for r in ColumnFilter(ColumnFilter.Config.model_validate(cfg))(ROWS, random.Random(0))]


def test_equals_in_and_invert():
    assert ids({"column": "level", "equals": 2}) == [1, 3]
    assert ids({"column": "level", "in": [1, 3]}) == [0, 2]
    assert ids({"column": "level", "in": [1, 3], "invert": True}) == [1, 3]


def test_matches_is_a_full_regex_match_on_strings():
    rows = [{"prompt": "12+3="}, {"prompt": "123*4="}, {"prompt": "12*4="}]
    f = ColumnFilter(ColumnFilter.Config.model_validate({"column": "prompt", "matches": r"\d{3}\*\d=", "invert": True}))
    assert [r["prompt"] for r in f(rows, random.Random(0))] == ["12+3=", "12*4="]
    # fullmatch: "2*4=" is inside "12*4=" but does not match it whole.
    g = ColumnFilter(ColumnFilter.Config.model_validate({"column": "prompt", "matches": r"\d\*4="}))
    assert g(rows, random.Random(0)) == []
    with pytest.raises(DataError, match="row 1: level: 'matches' needs a string, got int"):
        ColumnFilter(ColumnFilter.Config.model_validate({"column": "level", "matches": "1"}))(ROWS, random.Random(0))
    with pytest.raises(ValidationError, match="not a valid regex"):
        ColumnFilter.Config.model_validate({"column": "prompt", "matches": "("})


def test_exactly_one_condition():
    with pytest.raises(ValidationError, match="exactly one"):
        ColumnFilter.Config.model_validate({"column": "level"})
    with pytest.raises(ValidationError, match="exactly one"):
        ColumnFilter.Config.model_validate({"column": "level", "equals": 1, "in": [1]})


def test_missing_column_names_the_row_unless_missing_ok():
    f = ColumnFilter(ColumnFilter.Config.model_validate({"column": "split", "equals": "train"}))
    with pytest.raises(DataError, match="row 1: split"):
        f(ROWS, random.Random(0))
    ok = ColumnFilter(ColumnFilter.Config.model_validate({"column": "split", "equals": "x", "missing_ok": True}))
    assert ok(ROWS, random.Random(0)) == []
