import math

import pytest
import torch

from alignflow.core.train.offline import UnpairedBatch
from alignflow.plugins.kto import KTO


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def batch(labels=(True, False, True), kl_policy=(-6.0, -7.0, -8.0), requires_grad=False):
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return UnpairedBatch(
        policy_logps=t([-2.0, -5.0, -3.0]), lengths=torch.tensor([3, 4, 5]), labels=torch.tensor(labels),
        ref_logps=t([-3.0, -4.0, -3.5]).detach(),
        policy_kl_logps=t(kl_policy), ref_kl_logps=t([-6.5, -8.0, -7.9]).detach(),
    )


def test_flags():
    assert KTO.stage == "preference" and KTO.requires_reference and KTO.requires_labels
    assert KTO.needs_kl_pairs and not KTO.requires_pairs


def test_loss_matches_the_halos_form():
    loss, metrics = KTO().loss(batch())
    z = max(0.0, ((-6.0 - -6.5) + (-7.0 - -8.0) + (-8.0 - -7.9)) / 3)  # 0.4667
    r = [-2.0 - -3.0, -5.0 - -4.0, -3.0 - -3.5]  # 1.0, -1.0, 0.5
    expected = ((1 - sigmoid(0.1 * (r[0] - z))) + (1 - sigmoid(0.1 * (z - r[1]))) + (1 - sigmoid(0.1 * (r[2] - z)))) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["kl"].item() == pytest.approx(z, rel=1e-12)
    chosen, rejected = metrics["rewards/chosen"], metrics["rewards/rejected"]  # means over 2 rows and 1
    assert (chosen.value.item(), chosen.count) == (pytest.approx((0.1 * 1.0 + 0.1 * 0.5) / 2), 2)
    assert (rejected.value.item(), rejected.count) == (pytest.approx(0.1 * -1.0), 1)
    assert metrics["rewards/margins"].item() == pytest.approx(0.075 - -0.1)
    assert metrics["rewards/accuracies"].item() == 1.0  # 1.0 > z, -1.0 < z, 0.5 > z


def test_reference_point_is_clamped_at_zero():
    loss, metrics = KTO().loss(batch(kl_policy=(-9.0, -9.0, -9.0)))
    r = [1.0, -1.0, 0.5]
    expected = ((1 - sigmoid(0.1 * r[0])) + (1 - sigmoid(0.1 * -r[1])) + (1 - sigmoid(0.1 * r[2]))) / 3
    assert metrics["kl"].item() == 0.0
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_weights_scale_desirable_and_undesirable_losses():
    loss, _ = KTO(KTO.Config(desirable_weight=2.0, undesirable_weight=0.5)).loss(batch())
    z = 1.4 / 3
    expected = (2 * (1 - sigmoid(0.1 * (1.0 - z))) + 0.5 * (1 - sigmoid(0.1 * (z + 1.0)))
                + 2 * (1 - sigmoid(0.1 * (0.5 - z)))) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_gradient_follows_labels_and_not_the_reference_point():
    b = batch(requires_grad=True)
    KTO().loss(b)[0].backward()
    g = b.policy_logps.grad
    assert g[0] < 0 and g[2] < 0 and g[1] > 0
    assert b.policy_kl_logps.grad is None  # z_ref is detached


def test_all_undesirable_batch_has_nan_chosen_reward_but_a_finite_loss():
    loss, metrics = KTO().loss(batch(labels=(False, False, False)))
    assert torch.isfinite(loss) and math.isnan(metrics["rewards/chosen"].value)


def test_step_metrics_do_not_depend_on_the_micro_batch_grouping():
    """Chosen and rejected rewards are means over their own rows, and the margin is between the step's means.

    Weighting a micro-batch's chosen mean by all its rows gave (0.1*2 + 0.05*1) / 3 for [0, 1] + [2] here.
    """
    from alignflow.flows.stages.offline_loop import Tally

    kto, full = KTO(), batch()
    whole = Tally()
    whole.add(kto.loss(full)[1], 3)
    parts = Tally()
    for rows in ([0, 1], [2]):
        part = UnpairedBatch(**{k: v[rows] for k, v in vars(full).items()})
        parts.add(kto.metrics(*_pieces(kto, part, full)), len(rows))
    one, two = kto.summarize(whole.means()), kto.summarize(parts.means())
    assert two["rewards/chosen"] == pytest.approx(0.075) and two["rewards/rejected"] == pytest.approx(-0.1)
    assert two["rewards/margins"] == pytest.approx(0.175)
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies"):
        assert two[key] == pytest.approx(one[key]), key


def _pieces(kto, part, full):
    """metrics() arguments for the rows of `part`, with the whole batch's reference point."""
    beta = kto.config.beta
    z = max(0.0, (full.policy_kl_logps - full.ref_kl_logps).mean().item())
    losses = kto.loss(part)[0].new_zeros(len(part.labels))
    return losses, beta * (part.policy_logps - part.ref_logps), part.labels.bool(), torch.tensor(beta * z)
