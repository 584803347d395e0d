import pytest
import torch

from alignflow.core.train.offline import PairBatch
from alignflow.plugins.ipo import IPO


def pairs(policy_chosen, policy_rejected, requires_grad=False):
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return PairBatch(
        policy_chosen_logps=t(policy_chosen), policy_rejected_logps=t(policy_rejected),
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([5, 2]),
        ref_chosen_logps=t([-2.0, -3.5]).detach(), ref_rejected_logps=t([-2.5, -2.5]).detach(),
    )


def test_flags():
    assert IPO.stage == "preference" and IPO.requires_reference and IPO.requires_pairs


def test_loss_uses_per_token_log_ratios_as_trl():
    loss, metrics = IPO().loss(pairs([-1.0, -4.0], [-3.0, -2.0]))
    h0 = (-1.0 - -2.0) / 2 - (-3.0 - -2.5) / 5  # 0.6
    h1 = (-4.0 - -3.5) / 4 - (-2.0 - -2.5) / 2  # -0.375
    target = 1 / (2 * 0.1)
    expected = ((h0 - target) ** 2 + (h1 - target) ** 2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * ((-1.0 - -2.0) / 2 + (-4.0 - -3.5) / 4) / 2)


def test_zero_at_the_target_margin_and_pulls_back_beyond_it():
    # h = (8 - -2)/2 - 0 = 5 = 1/(2 beta): the loss and its gradient vanish.
    at_target = pairs([8.0, 16.5], [-2.5, -2.5], requires_grad=True)
    loss, _ = IPO().loss(at_target)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-20)
    assert at_target.policy_chosen_logps.grad.abs().max().item() == pytest.approx(0.0, abs=1e-12)
    # Past the target, unlike DPO, IPO lowers the chosen log-prob: its regulariser.
    beyond = pairs([10.0, 20.0], [-2.5, -2.5], requires_grad=True)
    IPO().loss(beyond)[0].backward()
    assert (beyond.policy_chosen_logps.grad > 0).all()
