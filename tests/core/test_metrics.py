import math

import pytest

from alignflow.core.metrics import mean_pass_at_k, pass_at_k


def test_pass_at_k_equals_the_binomial_formula():
    # 1 - C(n-c, k) / C(n, k) for small cases, computed with exact integers
    for n, c, k in [(10, 3, 1), (10, 3, 5), (5, 0, 2), (5, 5, 3), (20, 1, 10), (8, 2, 7)]:
        expected = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_1_is_the_fraction_correct_and_average_over_problems():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert mean_pass_at_k([0, 2, 4], n=4, k=1) == pytest.approx((0 + 0.5 + 1) / 3)


def test_large_n_is_stable_and_k_above_n_is_an_error():
    assert pass_at_k(1000, 1, 100) == pytest.approx(0.1)  # C(999,100)/C(1000,100) = 900/1000
    with pytest.raises(ValueError, match="at least 5 samples"):
        pass_at_k(4, 1, 5)
