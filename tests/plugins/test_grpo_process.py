import math

import pytest
import torch

from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.grpo_process import ProcessGRPO


def rollout():
    """Prompt 0: response A has steps ending at t=1 (PRM 0.9) and t=4 (0.2), B one at t=2 (0.5);
    prompt 1: one response, one step. Position 0 is a prompt token (outside the response mask)."""
    step_rewards = torch.zeros(3, 6)
    step_mask = torch.zeros(3, 6)
    for row, t, r in [(0, 1, 0.9), (0, 4, 0.2), (1, 2, 0.5), (2, 3, 0.7)]:
        step_rewards[row, t], step_mask[row, t] = r, 1.0
    mask = torch.ones(3, 6)
    mask[:, 0] = 0
    return Rollout(rewards=torch.zeros(3), group=torch.tensor([0, 0, 1]), response_mask=mask,
                   old_logprobs=torch.zeros(3, 6), max_new_tokens=5, step_rewards=step_rewards, step_mask=step_mask)


def test_flags():
    assert ProcessGRPO.requires_step_rewards and ProcessGRPO.stage == "rl"


def test_advantage_is_the_sum_of_normalised_rewards_of_the_steps_still_to_come():
    # prompt 0's step rewards 0.9, 0.2, 0.5: mean 0.53333, unbiased std 0.35119
    mean = (0.9 + 0.2 + 0.5) / 3
    std = math.sqrt(sum((r - mean) ** 2 for r in (0.9, 0.2, 0.5)) / 2)
    a1, a4, b2 = ((r - mean) / (std + 1e-6) for r in (0.9, 0.2, 0.5))
    assert (a1, a4, b2) == pytest.approx((1.044075, -0.949158, -0.094917), abs=1e-5)
    adv, returns = ProcessGRPO().advantages(rollout())
    assert returns is None
    expected = torch.tensor([
        [0.0, a1 + a4, a4, a4, a4, 0.0],  # t=0 is the prompt; t=5 comes after the last step
        [0.0, b2, b2, 0.0, 0.0, 0.0],
        [0.0] * 6,  # a step alone in its group has no baseline: 0
    ])
    assert torch.allclose(adv, expected, atol=1e-6)


def test_without_std_scaling_the_step_rewards_are_only_centred():
    from alignflow.plugins.grpo import GRPOConfig

    adv, _ = ProcessGRPO(GRPOConfig(scale_rewards=False)).advantages(rollout())
    mean = (0.9 + 0.2 + 0.5) / 3
    assert adv[0, 1].item() == pytest.approx((0.9 - mean) + (0.2 - mean), abs=1e-6)
    assert adv[1, 1].item() == pytest.approx(0.5 - mean, abs=1e-6)
