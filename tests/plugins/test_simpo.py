import math

import pytest
import torch

from alignflow.core.train.offline import PairBatch
from alignflow.plugins.simpo import SimPO


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def pairs(requires_grad=False):
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return PairBatch(
        policy_chosen_logps=t([-1.0, -4.0]), policy_rejected_logps=t([-3.0, -2.0]),
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([5, 2]),
    )


def test_flags_and_defaults():
    assert SimPO.stage == "preference" and SimPO.requires_pairs and not SimPO.requires_reference
    assert SimPO.Config().beta == 2.0 and SimPO.Config().gamma_beta_ratio == 0.25


def test_loss_is_the_papers_length_normalised_margin_loss():
    loss, metrics = SimPO().loss(pairs())
    beta, gamma = 2.0, 0.25 * 2.0
    z0 = beta / 2 * -1.0 - beta / 5 * -3.0 - gamma  # -0.3
    z1 = beta / 4 * -4.0 - beta / 2 * -2.0 - gamma  # -0.5
    expected = (-math.log(sigmoid(z0)) - math.log(sigmoid(z1))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx((beta / 2 * -1.0 + beta / 4 * -4.0) / 2)
    assert metrics["rewards/accuracies"].item() == 0.5  # -1.0 > -1.2, -2.0 == -2.0


def test_gamma_is_a_ratio_of_beta():
    loss, _ = SimPO(SimPO.Config(beta=10.0, gamma_beta_ratio=0.5)).loss(pairs())
    z0 = 10.0 / 2 * -1.0 - 10.0 / 5 * -3.0 - 5.0
    z1 = 10.0 / 4 * -4.0 - 10.0 / 2 * -2.0 - 5.0
    assert loss.item() == pytest.approx((-math.log(sigmoid(z0)) - math.log(sigmoid(z1))) / 2, rel=1e-12)


def test_gradient_raises_chosen_and_lowers_rejected():
    batch = pairs(requires_grad=True)
    SimPO().loss(batch)[0].backward()
    assert (batch.policy_chosen_logps.grad < 0).all() and (batch.policy_rejected_logps.grad > 0).all()
