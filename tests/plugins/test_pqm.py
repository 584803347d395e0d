import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import StepBatch
from alignflow.plugins.pqm import PQM


def batch(rows=slice(None), dtype=torch.float64):
    """Solution A: steps Q = (1, 2, -1) labelled correct, correct, wrong; B: one correct step, Q = 0.5."""
    t = lambda v: torch.tensor(v, dtype=dtype)[rows]  # noqa: E731
    return StepBatch(scores=t([[1.0, 2.0, -1.0], [0.5, 9.0, 9.0]]).requires_grad_(),
                     labels=t([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]]), mask=t([[1, 1, 1], [1, 0, 0]]))


def test_flags():
    assert PQM.stage == "prm" and PQM().config.zeta == 4.0


def test_loss_is_the_papers_ranking_loss_by_hand():
    e = math.exp
    # A, zeta = 4: the wrong step weighs e^(-1 + 4) = e^3 = 20.0855 below Q_0 = 0 (weight 1)
    first = -math.log(e(1) / (e(1) + 1 + e(3)))  # 2.16985: outranks Q_0 and the wrong step
    second = -math.log(e(2) / (e(2) + e(1) + 1 + e(3)))  # 1.44019: also the first correct step
    initial = -math.log(1 / (1 + e(3)))  # 3.04859: Q_0 outranks the wrong step
    a = (first + second + initial) / 3  # 2.21954
    b = -math.log(e(0.5) / (e(0.5) + 1))  # 0.474077: no wrong step, so no initial-state term
    assert (first, second, initial, b) == pytest.approx((2.169846, 1.440190, 3.048587, 0.474077), abs=1e-6)
    loss, metrics = PQM().loss(batch())
    assert loss.item() == pytest.approx((a + b) / 2, rel=1e-12)
    # the official code's cumulative sum also counts Q_t itself from the second correct step on
    assert loss.item() != pytest.approx((first - math.log(e(2) / (2 * e(2) + e(1) + 1 + e(3))) + initial) / 6 + b / 2)
    # Q > 0 (above the initial state) reads as correct: 1, 2 and 0.5 right, -1 right -> 4 of 4
    assert metrics["accuracy"].item() == 1.0


def test_gradients_are_finite_without_wrong_steps_and_micro_batches_sum_to_the_step():
    whole, _ = PQM().loss(batch())
    norm = StepNorm(num_tokens=4, num_seqs=2)
    parts = [PQM().loss(batch(slice(i, i + 1)), norm)[0] for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
    only_correct = batch(slice(1, 2), torch.float32)
    loss, _ = PQM().loss(only_correct)
    loss.backward()
    assert torch.isfinite(only_correct.scores.grad).all()
    assert only_correct.scores.grad[0, 1:].abs().sum() == 0  # padding gets no gradient
