import pytest
import torch

from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.ppo import PPO, PPOConfig
from alignflow.plugins.ppo_process import ProcessPPO, ProcessPPOConfig


def rollout(step_rewards=((2, 0.9), (4, 0.3))):
    """One response: t=0 is the prompt, t=1..4 the response; steps end at t=2 (PRM 0.9) and t=4 (0.3);
    outcome R = 1; log pi_old - log pi_ref = (0.1, -0.2, 0, 0.3) at t=1..4; V = (0.5, 0.4, 0.2, 0.1)."""
    mask = torch.tensor([[0.0, 1, 1, 1, 1]])
    rewards, at_step = torch.zeros(1, 5), torch.zeros(1, 5)
    for t, r in step_rewards:
        rewards[0, t], at_step[0, t] = r, 1.0
    old = torch.tensor([[0.0, 0.1, -0.2, 0.0, 0.3]])
    return Rollout(rewards=torch.tensor([1.0]), group=torch.tensor([0]), response_mask=mask,
                   old_logprobs=old, ref_logprobs=torch.zeros(1, 5), max_new_tokens=4,
                   values=torch.tensor([[0.0, 0.5, 0.4, 0.2, 0.1]]), step_rewards=rewards, step_mask=at_step)


def test_flags_and_math_shepherd_defaults():
    assert ProcessPPO.requires_step_rewards and ProcessPPO.requires_critic and ProcessPPO.stage == "rl"
    c = ProcessPPOConfig()
    assert (c.kl_coef, c.step_reward, c.gamma, c.lam) == (0.04, "raw", 1.0, 0.95)


def test_step_scores_enter_the_token_rewards_before_gae():
    # r_t = step score at the step's last token + R at the last token - 0.04 x k1:
    #   t1: -0.004, t2: 0.9 + 0.008 = 0.908, t3: 0, t4: 0.3 + 1 - 0.012 = 1.288
    # delta_t = r_t + V_{t+1} - V_t: d4 = 1.188, d3 = -0.1, d2 = 0.708, d1 = -0.104
    # A_t = d_t + 0.95 A_{t+1}: A4 = 1.188, A3 = 1.0286, A2 = 1.68517, A1 = 1.4969115
    algo = ProcessPPO(ProcessPPOConfig(whiten_advantages=False))
    rewards = algo.token_rewards(rollout())
    assert torch.allclose(rewards, torch.tensor([[0.0, -0.004, 0.908, 0.0, 1.288]]), atol=1e-6)
    adv, returns = algo.advantages(rollout())
    assert torch.allclose(adv, torch.tensor([[0.0, 1.4969115, 1.68517, 1.0286, 1.188]]), atol=1e-5)
    assert torch.allclose(returns, torch.tensor([[0.0, 1.9969115, 2.08517, 1.2286, 1.288]]), atol=1e-5)


def test_clipped_step_rewards_are_never_positive():
    # min(s - 0.5, 0): 0.9 -> 0, 0.3 -> -0.2; r = (-0.004, 0.008, 0, 1 - 0.2 - 0.012 = 0.788)
    # d4 = 0.688, d3 = -0.1, d2 = -0.192, d1 = -0.104; A4 = 0.688, A3 = 0.5536, A2 = 0.33392, A1 = 0.213224
    algo = ProcessPPO(ProcessPPOConfig(whiten_advantages=False, step_reward="clip", clip_eta=0.5))
    assert torch.allclose(algo.token_rewards(rollout()), torch.tensor([[0.0, -0.004, 0.008, 0.0, 0.788]]), atol=1e-6)
    adv, _ = algo.advantages(rollout())
    assert torch.allclose(adv, torch.tensor([[0.0, 0.213224, 0.33392, 0.5536, 0.688]]), atol=1e-5)


def test_without_step_rewards_it_is_ppo():
    config = dict(whiten_advantages=False, kl_coef=0.04)
    adv, returns = ProcessPPO(ProcessPPOConfig(**config)).advantages(rollout(step_rewards=()))
    ppo_adv, ppo_returns = PPO(PPOConfig(**config)).advantages(rollout(step_rewards=()))
    assert torch.equal(adv, ppo_adv) and torch.equal(returns, ppo_returns)
    # and an extra step adds its score to every earlier token's advantage (gamma = lambda = 1, V = 0)
    one = ProcessPPO(ProcessPPOConfig(whiten_advantages=False, kl_coef=0.0, lam=1.0))
    r = rollout(step_rewards=((2, 0.9),))
    r.values.zero_()
    adv, _ = one.advantages(r)
    assert adv[0, 1:].tolist() == pytest.approx([1.9, 1.9, 1.0, 1.0])
