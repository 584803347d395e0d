import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.train.offline import PairBatch
from alignflow.plugins.dpo import DPO


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def pairs(requires_grad=False):
    """Two pairs: policy/reference summed log-probs of chosen and rejected completions."""
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return PairBatch(
        policy_chosen_logps=t([-1.0, -4.0]), policy_rejected_logps=t([-3.0, -2.0]),
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([5, 2]),
        ref_chosen_logps=torch.tensor([-2.0, -3.5], dtype=torch.float64),
        ref_rejected_logps=torch.tensor([-2.5, -2.5], dtype=torch.float64),
    )


def test_flags():
    assert DPO.stage == "preference" and DPO.requires_reference and DPO.requires_pairs
    assert not DPO.requires_labels and DPO().nll_scope is None


def test_loss_is_the_papers_sigmoid_loss():
    loss, metrics = DPO().loss(pairs())
    h0 = (-1.0 - -2.0) - (-3.0 - -2.5)  # 1.5
    h1 = (-4.0 - -3.5) - (-2.0 - -2.5)  # -1.0
    expected = (-math.log(sigmoid(0.1 * h0)) - math.log(sigmoid(0.1 * h1))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["loss"].item() == pytest.approx(expected, rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx((0.1 * 1.0 + 0.1 * -0.5) / 2)
    assert metrics["rewards/rejected"].item() == pytest.approx((0.1 * -0.5 + 0.1 * 0.5) / 2)
    assert metrics["rewards/margins"].item() == pytest.approx((0.1 * h0 + 0.1 * h1) / 2)
    assert metrics["rewards/accuracies"].item() == 0.5


def test_label_smoothing_is_conservative_dpo():
    loss, _ = DPO(DPO.Config(beta=0.5, label_smoothing=0.1)).loss(pairs())
    per_pair = [-(0.9) * math.log(sigmoid(0.5 * h)) - 0.1 * math.log(sigmoid(-0.5 * h)) for h in (1.5, -1.0)]
    assert loss.item() == pytest.approx(sum(per_pair) / 2, rel=1e-12)


def test_gradient_raises_chosen_and_lowers_rejected():
    batch = pairs(requires_grad=True)
    DPO().loss(batch)[0].backward()
    # d/d pi_c of -log sigma(beta h) = -beta * sigma(-beta h), averaged over 2 pairs
    assert batch.policy_chosen_logps.grad[0].item() == pytest.approx(-0.1 * sigmoid(-0.15) / 2, rel=1e-12)
    assert (batch.policy_chosen_logps.grad < 0).all() and (batch.policy_rejected_logps.grad > 0).all()


def test_config_is_validated():
    with pytest.raises(ValidationError):
        DPO.Config(beta=0.0)
    with pytest.raises(ValidationError):
        DPO.Config(label_smoothing=0.5)
    with pytest.raises(ValidationError):
        DPO.Config(betta=0.1)
