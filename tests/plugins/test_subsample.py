import random

import pytest
from pydantic import ValidationError

from alignflow.plugins.subsample import Subsample

ROWS = [{"i": i} for i in range(100)]


def test_n_distinct_rows_in_original_order_and_seeded():
    sub = Subsample(Subsample.Config(n=10))
    a = sub(ROWS, random.Random(3))
    assert len(a) == 10 and len({r["i"] for r in a}) == 10
    assert [r["i"] for r in a] == sorted(r["i"] for r in a)
    assert a == sub(ROWS, random.Random(3))
    assert a != sub(ROWS, random.Random(4))


def test_own_seed_overrides_stage_rng_and_small_input_is_kept_whole():
    sub = Subsample(Subsample.Config(n=5, seed=7))
    assert sub(ROWS, random.Random(0)) == sub(ROWS, random.Random(1))
    assert Subsample(Subsample.Config(n=200))(ROWS, random.Random(0)) == ROWS


def test_n_must_be_positive():
    with pytest.raises(ValidationError):
        Subsample.Config(n=0)
