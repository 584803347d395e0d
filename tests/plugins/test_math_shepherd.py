import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import StepBatch
from alignflow.plugins.math_shepherd import MathShepherd


def batch(rows=slice(None)):
    """Two solutions: steps scored (0, 2) labelled (1, 0), and one step scored -1 with a soft label 0.25."""
    t = lambda v: torch.tensor(v, dtype=torch.float64)[rows]  # noqa: E731
    return StepBatch(scores=t([[0.0, 2.0], [-1.0, 5.0]]).requires_grad_(), labels=t([[1.0, 0.0], [0.25, 0.0]]),
                     mask=t([[1.0, 1.0], [1.0, 0.0]]))


def bce(s, y):
    """-[y log sigma(s) + (1 - y) log(1 - sigma(s))], the paper's step loss."""
    sig = 1 / (1 + math.exp(-s))
    return -(y * math.log(sig) + (1 - y) * math.log(1 - sig))


def test_flags():
    assert MathShepherd.stage == "prm" and MathShepherd.batch_type is StepBatch


def test_loss_is_the_mean_step_cross_entropy_padding_excluded():
    loss, metrics = MathShepherd().loss(batch())
    # log 2 = 0.693147, softplus(2) = 2.126928, softplus(-1) + 0.25 = 0.563262; the padded step (5.0) is out
    expected = (bce(0.0, 1) + bce(2.0, 0) + bce(-1.0, 0.25)) / 3
    assert expected == pytest.approx((0.693147 + 2.126928 + 0.563262) / 3, abs=1e-6)
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    # predicted correct (score > 0): no, yes, no; labelled correct (> 0.5): yes, no, no -> 1 of 3 right
    assert metrics["accuracy"].item() == pytest.approx(1 / 3)
    assert metrics["steps/positive"].item() == pytest.approx(1 / 3)


def test_micro_batches_sum_to_the_whole_step():
    whole, _ = MathShepherd().loss(batch())
    norm = StepNorm(num_tokens=3, num_seqs=2)
    parts = [MathShepherd().loss(batch(slice(i, i + 1)), norm)[0] for i in range(2)]
    assert sum(p.item() for p in parts) == pytest.approx(whole.item(), rel=1e-12)
