import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm
from alignflow.core.train.offline import RewardBatch
from alignflow.plugins.bradley_terry import BradleyTerry


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def scores(margin=None, requires_grad=False):
    t = lambda v: torch.tensor(v, dtype=torch.float64, requires_grad=requires_grad)
    return RewardBatch(chosen_scores=t([1.0, 0.5]), rejected_scores=t([0.0, 1.5]),
                       margin=None if margin is None else t(margin))


def test_flags():
    assert BradleyTerry.stage == "reward_model" and BradleyTerry.requires_pairs
    assert not BradleyTerry.requires_reference


def test_loss_and_metrics():
    loss, metrics = BradleyTerry().loss(scores())
    expected = (-math.log(sigmoid(1.0 - 0.0)) - math.log(sigmoid(0.5 - 1.5))) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)
    assert metrics["accuracy"].item() == 0.5
    assert metrics["rewards/chosen"].item() == 0.75 and metrics["rewards/rejected"].item() == 0.75


def test_margin_column_wins_over_config_margin():
    column, _ = BradleyTerry(BradleyTerry.Config(margin=0.2)).loss(scores(margin=[0.5, 0.0]))
    assert column.item() == pytest.approx((-math.log(sigmoid(1.0 - 0.5)) - math.log(sigmoid(-1.0))) / 2, rel=1e-12)
    config, _ = BradleyTerry(BradleyTerry.Config(margin=0.2)).loss(scores())
    assert config.item() == pytest.approx((-math.log(sigmoid(0.8)) - math.log(sigmoid(-1.2))) / 2, rel=1e-12)


def test_center_rewards_penalises_the_squared_sum():
    loss, _ = BradleyTerry(BradleyTerry.Config(center_rewards_coefficient=0.01)).loss(scores())
    expected = (-math.log(sigmoid(1.0)) + 0.01 * 1.0**2 - math.log(sigmoid(-1.0)) + 0.01 * 2.0**2) / 2
    assert loss.item() == pytest.approx(expected, rel=1e-12)


def test_step_normalisation_and_gradient_direction():
    b = scores(requires_grad=True)
    share, _ = BradleyTerry().loss(b, StepNorm(num_tokens=0.0, num_seqs=8.0))
    share.backward()
    assert share.item() == pytest.approx((-math.log(sigmoid(1.0)) - math.log(sigmoid(-1.0))) / 8, rel=1e-12)
    assert (b.chosen_scores.grad < 0).all() and (b.rejected_scores.grad > 0).all()
