import random

import pytest

from alignflow.core.errors import DataError
from alignflow.plugins.curriculum import Curriculum

ROWS = [{"level": 3, "id": 0}, {"level": 1, "id": 1}, {"level": 2, "id": 2},
        {"level": 1, "id": 3}, {"level": 3, "id": 4}]


def ids(cfg: dict, rows=ROWS) -> list[int]:
    return [r["id"] for r in Curriculum(Curriculum.Config.model_validate(cfg))(rows, random.Random(0))]


def test_ascending_by_level_ties_in_input_order():
    # level 1: ids 1, 3; level 2: id 2; level 3: ids 0, 4.
    assert ids({}) == [1, 3, 2, 0, 4]


def test_descending_keeps_ties_in_input_order_too():
    # level 3: 0, 4 (not 4, 0 as reversing the ascending order would give); then 2; then 1, 3.
    assert ids({"order": "descending"}) == [0, 4, 2, 1, 3]


def test_pass_rate_descending_is_easy_first_and_rows_are_kept_whole():
    rows = [{"pass_rate": 0.2, "id": 0}, {"pass_rate": 0.9, "id": 1}, {"pass_rate": 0.5, "id": 2}]
    out = Curriculum(Curriculum.Config(column="pass_rate", order="descending"))(rows, random.Random(0))
    assert out == [rows[1], rows[2], rows[0]]


def test_missing_column_names_the_row():
    with pytest.raises(DataError, match="row 2: level: missing"):
        ids({}, [{"level": 1}, {"id": 1}])
