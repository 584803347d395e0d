import math
from dataclasses import fields

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import PairBatch
from alignflow.plugins.orpo import ORPO


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def log_odds(mean_logp):
    return mean_logp - math.log(1 - math.exp(mean_logp))


def pairs(chosen=(-1.0, -4.0), rejected=(-3.0, -2.0), requires_grad=False):
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return PairBatch(
        policy_chosen_logps=t(chosen), policy_rejected_logps=t(rejected),
        chosen_lengths=torch.tensor([2, 4]), rejected_lengths=torch.tensor([5, 2]),
        # chosen sequences including prompt tokens: 4 and 6 tokens
        chosen_nll_logps=t([-3.0, -6.0]), chosen_nll_tokens=torch.tensor([4, 6]),
    )


def take(batch, rows):
    """The micro-batch of these rows."""
    return PairBatch(**{f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name)[rows]
                        for f in fields(batch)})


def test_flags_and_nll_scope():
    assert ORPO.stage == "preference" and ORPO.requires_pairs and not ORPO.requires_reference
    assert ORPO().nll_scope == "sequence"  # the official code trains on prompt tokens too
    assert ORPO(ORPO.Config(nll_includes_prompt=False)).nll_scope == "completion"
    assert ORPO.Config().alpha == 0.1


def test_loss_is_nll_plus_weighted_odds_ratio_loss():
    loss, metrics = ORPO().loss(pairs())
    ratio0 = log_odds(-1.0 / 2) - log_odds(-3.0 / 5)
    ratio1 = log_odds(-4.0 / 4) - log_odds(-2.0 / 2)
    or_loss = 0.1 * (-math.log(sigmoid(ratio0)) - math.log(sigmoid(ratio1))) / 2
    nll = (3.0 + 6.0) / (4 + 6)  # token mean over the chosen sequences
    assert loss.item() == pytest.approx(nll + or_loss, rel=1e-12)
    assert metrics["loss"].item() == pytest.approx(nll + or_loss, rel=1e-12)
    assert metrics["nll_loss"].item() == pytest.approx(nll, rel=1e-12)
    assert metrics["log_odds_ratio"].item() == pytest.approx((ratio0 + ratio1) / 2, rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx(0.1 * (-0.5 + -1.0) / 2)


def test_micro_batch_shares_add_up_to_the_step_loss():
    full, _ = ORPO().loss(pairs())
    norm = StepNorm(num_tokens=10.0, num_seqs=2.0)
    shares = [ORPO().loss(take(pairs(), slice(i, i + 1)), norm)[0] for i in (0, 1)]
    assert (shares[0] + shares[1]).item() == pytest.approx(full.item(), rel=1e-12)


def test_log_odds_stay_accurate_and_finite_near_probability_one():
    # mean log-prob -1e-9: log(1 - e^x) = log(-expm1(x)), which a naive log(1 - exp(x)) in float32 gets as -inf.
    batch = pairs(chosen=(-2e-9, -4.0), rejected=(-3.0, -2.0), requires_grad=True)
    _, metrics = ORPO().loss(batch)
    ratio0 = (-1e-9 - math.log(-math.expm1(-1e-9))) - log_odds(-3.0 / 5)
    ratio1 = log_odds(-1.0) - log_odds(-1.0)
    assert metrics["log_odds_ratio"].item() == pytest.approx((ratio0 + ratio1) / 2, rel=1e-9)
    exact = pairs(chosen=(0.0, 0.0), rejected=(0.0, -2.0), requires_grad=True)
    loss, _ = ORPO().loss(exact)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(exact.policy_rejected_logps.grad).all()


def test_gradient_raises_chosen_and_lowers_rejected():
    batch = pairs(requires_grad=True)
    ORPO().loss(batch)[0].backward()
    assert (batch.policy_chosen_logps.grad < 0).all() and (batch.policy_rejected_logps.grad > 0).all()
    assert (batch.chosen_nll_logps.grad == -1 / 10).all()


def test_missing_nll_is_a_clear_error():
    b = pairs()
    with pytest.raises(ValueError, match="chosen_nll_logps"):
        ORPO().loss(PairBatch(b.policy_chosen_logps, b.policy_rejected_logps, b.chosen_lengths, b.rejected_lengths))
