"""PPO: k1 KL in the reward, GAE on the critic's values, clipped value loss."""

import pytest
import torch

from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.ppo import PPO, PPOConfig


def rollout(**kw):
    return Rollout(rewards=torch.tensor([1.0]), group=torch.tensor([0]), response_mask=torch.ones(1, 3),
                   old_logprobs=torch.full((1, 3), -1.0), ref_logprobs=torch.full((1, 3), -1.1),
                   values=torch.tensor([[0.5, 0.6, 0.7]]), max_new_tokens=3, **kw)


def test_defaults_and_flags():
    algo = PPO()
    c = algo.config
    assert (c.kl_coef, c.gamma, c.lam, c.value_clip, c.clip_low, c.clip_high) == (0.05, 1.0, 0.95, 0.2, 0.2, 0.2)
    assert algo.requires_critic and algo.requires_reference and algo.loss_agg_mode == "token-mean"


def test_gae_on_kl_penalised_rewards():
    adv, returns = PPO(PPOConfig(whiten_advantages=False)).advantages(rollout())
    # r_t = -0.05 * 0.1 on every token, + 1 at the last; V = [0.5, 0.6, 0.7], V past the end = 0
    d2 = 1 - 0.005 - 0.7
    d1 = -0.005 + 0.7 - 0.6
    d0 = -0.005 + 0.6 - 0.5
    a2, a1 = d2, d1 + 0.95 * d2
    a0 = d0 + 0.95 * a1
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, a2]]))
    torch.testing.assert_close(returns, torch.tensor([[a0 + 0.5, a1 + 0.6, a2 + 0.7]]))
    whitened, _ = PPO().advantages(rollout())
    mean = (a0 + a1 + a2) / 3
    std = (((a0 - mean) ** 2 + (a1 - mean) ** 2 + (a2 - mean) ** 2) / 3) ** 0.5
    torch.testing.assert_close(whitened, (torch.tensor([[a0, a1, a2]]) - mean) / std)


def test_clipped_value_loss_and_gradient():
    algo = PPO()
    r = rollout()
    values = torch.tensor([[1.0, 0.0, 0.6]], requires_grad=True)
    r.values = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    batch = r.minibatch(torch.tensor([0]), logprobs=torch.zeros(1, 3), advantages=torch.zeros(1, 3),
                        returns=returns, values=values)
    per_token, metrics = algo.value_loss(batch)
    # token 0: max((1-2)^2, (0.7-2)^2) = 1.69; token 1: max(0, 0.3^2); token 2: both (0.6-1)^2
    torch.testing.assert_close(per_token, 0.1 * 0.5 * torch.tensor([[1.69, 0.09, 0.16]]))
    per_token.sum().backward()
    # the clipped branch is flat in V (tokens 0, 1); token 2: 0.1 * (V - R)
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 0.1 * -0.4]]))
    assert metrics["critic/clip_frac"].item() == pytest.approx(2 / 3)
