import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.train.offline import PairBatch
from alignflow.plugins.dpo import DPO
from alignflow.plugins.spin import SPIN


def spin_batch(real, generated, opp_real, opp_generated):
    """chosen = the data completion y, rejected = the model's own generation y', reference = the opponent p_t."""
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=True)
    n = len(real)
    return PairBatch(
        policy_chosen_logps=t(real), policy_rejected_logps=t(generated),
        chosen_lengths=torch.full((n,), 3), rejected_lengths=torch.full((n,), 3),
        ref_chosen_logps=torch.tensor(opp_real, dtype=torch.float64),
        ref_rejected_logps=torch.tensor(opp_generated, dtype=torch.float64),
    )


def test_flags_and_defaults():
    assert SPIN.stage == "preference" and SPIN.requires_reference and SPIN.requires_pairs
    assert SPIN().config.beta == 0.1  # the paper's lambda; uclaml/SPIN configs/config*.yaml `beta: 0.1`
    assert SPIN().config.label_smoothing == 0.0 and SPIN().nll_scope is None


def test_config_rejects_label_smoothing_and_bad_lambda():
    with pytest.raises(ValidationError):
        SPIN.Config(label_smoothing=0.1)  # not part of SPIN's loss
    with pytest.raises(ValidationError):
        SPIN.Config(beta=0.0)


def test_loss_is_the_logistic_loss_of_the_papers_margin():
    batch = spin_batch([-2.0, -6.0], [-5.0, -3.0], [-2.5, -5.0], [-4.0, -3.5])
    loss, metrics = SPIN().loss(batch)
    # pair 0: (-2 - -2.5) - (-5 - -4) = 0.5 + 1.0 = 1.5; l(0.1 * 1.5) = log(1 + e^-0.15) = 0.620957...
    # pair 1: (-6 - -5) - (-3 - -3.5) = -1.0 - 0.5 = -1.5; l(-0.15) = log(1 + e^0.15) = 0.770957...
    expected = (math.log(1 + math.exp(-0.15)) + math.log(1 + math.exp(0.15))) / 2  # 0.695957...
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert loss.item() == pytest.approx(0.695957, abs=1e-6)
    # rewards: lambda * log p/p_t of y: 0.1 * (0.5 + -1.0) / 2; of y': 0.1 * (-1.0 + 0.5) / 2
    assert metrics["rewards/chosen"].item() == pytest.approx(-0.025)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.025)
    assert metrics["rewards/accuracies"].item() == 0.5


def test_lambda_scales_the_margin():
    batch = spin_batch([-2.0], [-5.0], [-2.5], [-4.0])  # margin 1.5
    loss, _ = SPIN(SPIN.Config(beta=0.5)).loss(batch)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-0.75)), rel=1e-12)  # l(0.5 * 1.5)


def test_first_step_of_an_iteration_pushes_data_up_and_own_generation_down():
    # at the start of iteration t the policy is the opponent p_t: margin 0, loss log 2 per pair, and
    # d l / d log p(y) = -lambda sigma(0) = -0.05, d / d log p(y') = +0.05, each over the 2 pairs
    batch = spin_batch([-2.0, -6.0], [-5.0, -3.0], [-2.0, -6.0], [-5.0, -3.0])
    loss, _ = SPIN().loss(batch)
    assert loss.item() == pytest.approx(math.log(2), rel=1e-12)
    loss.backward()
    assert batch.policy_chosen_logps.grad.tolist() == pytest.approx([-0.025, -0.025], rel=1e-12)
    assert batch.policy_rejected_logps.grad.tolist() == pytest.approx([0.025, 0.025], rel=1e-12)


def test_no_gradient_once_the_model_generates_the_data():
    # SPIN's fixed point (its Theorem: p_theta = p_data): when y' is the data completion y itself, the pushes on
    # its log-prob cancel, -lambda sigma(0) + lambda sigma(0) = 0, whatever the opponent
    logp = torch.tensor([-2.0, -4.0], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([-3.0, -1.0], dtype=torch.float64)
    batch = PairBatch(logp, logp, torch.tensor([3, 3]), torch.tensor([3, 3]), ref, ref)
    loss, _ = SPIN().loss(batch)
    loss.backward()
    assert loss.item() == pytest.approx(math.log(2), rel=1e-12)
    assert logp.grad.tolist() == [0.0, 0.0]


def test_is_dpo_without_label_smoothing():
    g = torch.Generator().manual_seed(0)
    r = lambda: -torch.rand(5, generator=g, dtype=torch.float64) * 10
    batch = PairBatch(r(), r(), torch.full((5,), 4), torch.full((5,), 4), r(), r())
    spin, _ = SPIN(SPIN.Config(beta=0.3)).loss(batch)
    dpo, _ = DPO(DPO.Config(beta=0.3, label_smoothing=0.0)).loss(batch)
    assert spin.item() == pytest.approx(dpo.item(), rel=1e-12)


def test_registers_as_spin():
    from alignflow.plugins import spin

    seen = {}
    spin.register_algorithms(lambda name, cls: seen.setdefault(name, cls))
    assert seen == {"spin": SPIN}
