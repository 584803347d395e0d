import random

import pytest
from pydantic import ValidationError

from alignflow.core.errors import DataError
from alignflow.plugins.quality import Quality, near_duplicate_key

ROWS = [
    {"prompt": "What is 2+2?", "score": 0.5, "id": 0},
    {"prompt": "what is 2 + 2 ?", "score": 0.9, "id": 1},  # a near-duplicate of row 0
    {"prompt": "What is 3*3?", "score": 0.7, "id": 2},
    {"prompt": "What is 3*4?", "score": 0.9, "id": 3},
    {"prompt": "What is 2+2?", "score": 0.8, "id": 4},  # same cluster as 0 and 1
    {"prompt": "What is 5-1?", "score": 0.1, "id": 5},
]


def ids(cfg: dict, rows=ROWS) -> list[int]:
    return [r["id"] for r in Quality(Quality.Config.model_validate(cfg))(rows, random.Random(0))]


def test_near_duplicate_key():
    assert near_duplicate_key("What is 2 + 2 ?") == near_duplicate_key("what is 2+2?") == "whatis2+2?"
    assert near_duplicate_key("Ｗhat") == "what"  # NFKC: a full-width letter is the ASCII one
    assert near_duplicate_key("12+3=") != near_duplicate_key("12*3=")


def test_top_k_one_per_cluster_in_input_order():
    # by score: 1 (0.9), 3 (0.9), 4 (0.8, cluster of 1: skipped), 2 (0.7), 0 (skipped), 5 (0.1).
    assert ids({"k": 3}) == [1, 2, 3]
    # two per cluster: 1, 3, 4 -> output in input order.
    assert ids({"k": 3, "per_cluster": 2}) == [1, 3, 4]
    # no cap: the plain top 4 are 1, 3, 4, 2.
    assert ids({"k": 4, "cluster_column": None}) == [1, 2, 3, 4]


def test_ties_go_to_the_earlier_row():
    # rows 1 and 3 both score 0.9: k=1 keeps row 1.
    assert ids({"k": 1}) == [1]


def test_fraction_rounds_down_and_caps_can_leave_fewer_rows():
    # 0.5 * 6 = 3 rows: same as k=3.
    assert ids({"fraction": 0.5}) == [1, 2, 3]
    # 0.3 * 6 = 1.8 -> 1 row.
    assert ids({"fraction": 0.3}) == [1]
    # four clusters only: k=6 with one per cluster keeps 4 rows (1, 3, 2, 5).
    assert ids({"k": 6}) == [1, 2, 3, 5]


def test_nested_score_of_evaluate_samples():
    rows = [{"prompt": "a", "rewards": {"judge": 1.0}}, {"prompt": "b", "rewards": {"judge": 3.0}},
            {"prompt": "c", "rewards": {"judge": None}}]
    sel = Quality(Quality.Config(column="rewards.judge", k=1))
    assert sel(rows[:2], random.Random(0)) == [rows[1]]
    with pytest.raises(DataError, match="row 3: rewards.judge: expected a number, got None"):
        sel(rows, random.Random(0))


def test_exactly_one_budget():
    with pytest.raises(ValidationError, match="exactly one of 'k' or 'fraction'"):
        Quality.Config()
    with pytest.raises(ValidationError, match="exactly one of 'k' or 'fraction'"):
        Quality.Config(k=3, fraction=0.5)
