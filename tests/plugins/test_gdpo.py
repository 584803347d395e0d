"""GDPO: every reward standardised within its group apart, summed with the stage's weights, then over the batch."""

import math

import pytest
import torch

from alignflow.core.rl.capabilities import RewardComponents, has
from alignflow.flows.stages.rl.rollout import Samples, raw_values
from alignflow.plugins.gdpo import GDPO, GDPOConfig, gdpo_advantages
from alignflow.plugins.grpo import GRPO
from helpers.rollouts import make_rollout

GROUP = torch.tensor([0, 0, 1, 1])
# two rewards, weights 1 and 0.5; group 0 differs on reward 1, group 1 on reward 2 (by 2)
VALUES = torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 3.0], [0.0, 1.0]])
WEIGHTS = (1.0, 0.5)


def expected_by_hand():
    a1 = 0.5 / (math.sqrt(0.5) + 1e-4)  # group 0, reward 1: mean 0.5, unbiased std sqrt(0.5); reward 2 constant: 0
    a2 = 1.0 / (math.sqrt(2.0) + 1e-4)  # group 1, reward 2: mean 2, centred +-1, std sqrt(2); reward 1 constant: 0
    combined = [a1, -a1, 0.5 * a2, -0.5 * a2]  # sum_n w_n A_n; batch mean 0
    std = math.sqrt((2 * a1**2 + 2 * (0.5 * a2) ** 2) / 3)  # unbiased over the 4 responses
    return torch.tensor(combined), torch.tensor([x / (std + 1e-4) for x in combined])


def test_defaults_and_capability():
    c = GDPOConfig()
    assert (c.eps, c.batch_normalize, c.kl_loss_coef, c.loss_agg_mode) == (1e-4, True, 0.04, "seq-mean-token-mean")
    assert has(GDPO(), RewardComponents) and not has(GRPO(), RewardComponents)


def test_advantages_by_hand():
    combined, expected = expected_by_hand()
    torch.testing.assert_close(gdpo_advantages(VALUES, torch.tensor(WEIGHTS), GROUP), expected)
    assert expected[0].item() == pytest.approx(1.095260, abs=1e-5)  # 0.707007 / (0.645416 + 1e-4)
    torch.testing.assert_close(gdpo_advantages(VALUES, torch.tensor(WEIGHTS), GROUP, batch_normalize=False),
                               combined)


def test_rollout_advantages_use_each_reward_not_the_total():
    # totals 1.5, 0.5 | 1.5, 0.5: GRPO gives both groups the same +-0.707; GDPO halves group 1, whose
    # difference is on the reward of weight 0.5
    r = make_rollout((1.5, 0.5, 1.5, 0.5), group=GROUP, reward_values=VALUES, reward_weights=WEIGHTS)
    adv, returns = GDPO().advantages(r)
    torch.testing.assert_close(adv, expected_by_hand()[1][:, None].expand(4, 4))
    assert returns is None
    grpo, _ = GRPO().advantages(r)
    assert grpo[0, 0].item() == pytest.approx(grpo[2, 0].item())
    assert adv[0, 0].item() == pytest.approx(2 * adv[2, 0].item(), rel=1e-4)


def test_none_counts_as_zero_and_one_reward_is_grpo_then_whitened():
    with_nan = VALUES.clone()
    with_nan[1, 0] = math.nan  # it was 0: same advantages
    torch.testing.assert_close(gdpo_advantages(with_nan, torch.tensor(WEIGHTS), GROUP), expected_by_hand()[1])
    # no reward_values (a rollout built by hand): the total as the one reward. rewards 1, 0 | 1, 1:
    # group 0 -> +-0.5 / (sqrt(0.5) + 1e-4), group 1 -> 0; batch std sqrt(2 a^2 / 3)
    adv, _ = GDPO().advantages(make_rollout((1.0, 0.0, 1.0, 1.0), group=GROUP))
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    b = a / (math.sqrt(2 * a**2 / 3) + 1e-4)
    torch.testing.assert_close(adv[:, 0], torch.tensor([b, -b, 0.0, 0.0]))


def test_the_stage_hands_each_rewards_raw_values():
    samples = Samples(prompt_ids=[[1]] * 3, completion_ids=[[2]] * 3, logprobs=None, group=[0, 0, 0],
                      reward=[1.0, 1.0, 1.0], correct=[False] * 3, truncated=[False] * 3,
                      values={"format": [1.0, None, 0.0], "accuracy": [0.0, 1.0, 1.0]})
    got = raw_values(samples, ["format", "accuracy"])
    torch.testing.assert_close(got, torch.tensor([[1.0, 0.0], [math.nan, 1.0], [0.0, 1.0]]), equal_nan=True)
