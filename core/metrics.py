"""Evaluation metrics: the unbiased pass@k estimator."""

from __future__ import annotations

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples, c correct (Chen et al. 2021, arXiv 2107.03374)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per problem, got n={n}")
    if n - c < k:
        return 1.0
    # 1 - C(n-c, k) / C(n, k) as a product, never through factorials
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(correct_counts: list[int], n: int, k: int) -> float:
    """pass@k averaged over problems, each with n samples of which `correct_counts[i]` are correct."""
    if not correct_counts:
        raise ValueError("pass@k over zero problems is undefined")
    return float(np.mean([pass_at_k(n, c, k) for c in correct_counts]))
