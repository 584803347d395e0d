import random

from alignflow.plugins.dedup import Dedup


def test_keeps_first_row_of_each_prompt_in_order():
    rows = [{"prompt": "1+1", "id": 0}, {"prompt": "2+2", "id": 1}, {"prompt": " 1+1 ", "id": 2},
            {"prompt": "2+2", "id": 3}, {"prompt": "3+3", "id": 4}]
    kept = Dedup()(rows, random.Random(0))
    assert [r["id"] for r in kept] == [0, 1, 4]


def test_strip_off_keeps_whitespace_variants_and_other_column():
    rows = [{"q": "a"}, {"q": "a "}, {"q": "a"}]
    kept = Dedup(Dedup.Config(column="q", strip=False))(rows, random.Random(0))
    assert kept == [{"q": "a"}, {"q": "a "}]
