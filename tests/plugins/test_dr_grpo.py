"""Dr. GRPO: no std division, sum over tokens divided by the generation budget."""

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm, aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.dr_grpo import DrGRPO, DrGRPOConfig
from alignflow.plugins.grpo import GRPO, GRPOConfig

LENGTHS = [1, 4, 2, 3]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])
BUDGET = 8


def rollout(rewards=(1.0, 0.0, 0.0, 1.0), group=(0, 0, 0, 0)):
    return Rollout(rewards=torch.tensor(rewards), group=torch.tensor(group), response_mask=MASK,
                   old_logprobs=torch.full((4, 4), -1.0), max_new_tokens=BUDGET)


def step_loss(algo, r, logprobs):
    adv, _ = algo.advantages(r)
    per_token, _ = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    norm = StepNorm.of([MASK], algo.norm_constant(r))
    return aggregate(per_token, MASK, algo.loss_agg_mode, norm)


def test_defaults():
    algo = DrGRPO()
    assert algo.config.kl_loss_coef == 0.0 and not algo.requires_reference
    assert algo.loss_agg_mode == "seq-mean-token-sum-norm"
    assert algo.norm_constant(rollout()) == BUDGET
    assert DrGRPO(DrGRPOConfig(norm_constant=3000)).norm_constant(rollout()) == 3000


def test_advantages_are_only_centred():
    adv, _ = DrGRPO().advantages(rollout())
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, -0.5, 0.5])[:, None] * MASK)


def test_difficulty_bias_removed():
    # A low-variance group (rewards 0.2, 0.1, 0.1, 0.1) against a high-variance one (1, 0, 0, 0).
    r = Rollout(rewards=torch.tensor([1.0, 0, 0, 0, 0.2, 0.1, 0.1, 0.1]), group=torch.arange(8) // 4,
                response_mask=torch.ones(8, 1), old_logprobs=torch.zeros(8, 1), max_new_tokens=1)
    grpo, dr = GRPO().advantages(r)[0][:, 0], DrGRPO().advantages(r)[0][:, 0]
    torch.testing.assert_close(grpo[4:], grpo[:4], rtol=1e-4, atol=1e-4)  # std scales the small group up
    torch.testing.assert_close(dr, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.075, -0.025, -0.025, -0.025]))


def test_loss_value_is_token_sum_over_budget():
    logprobs = torch.full((4, 4), -1.0, requires_grad=True)
    loss = step_loss(DrGRPO(), rollout(), logprobs)
    # (1/B) sum_i sum_t (-A_i) / L = -(0.5*1 - 0.5*4 - 0.5*2 + 0.5*3) / (4 * 8)
    assert loss.item() == pytest.approx(1 / 32)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([-0.5, 0.5, 0.5, -0.5])[:, None] * MASK / 32)


def test_length_bias_removed():
    # Wrong answers of lengths 4 and 2: GRPO pushes each token of the long one half as hard, Dr. GRPO equally.
    grads = {}
    for name, algo in {"grpo": GRPO(GRPOConfig(kl_loss_coef=0.0)), "dr": DrGRPO()}.items():
        logprobs = torch.full((4, 4), -1.0, requires_grad=True)
        step_loss(algo, rollout(), logprobs).backward()
        grads[name] = logprobs.grad[1, 0].item() / logprobs.grad[2, 0].item()
    assert grads["grpo"] == pytest.approx(2 / 4) and grads["dr"] == pytest.approx(1.0)
