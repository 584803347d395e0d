"""REINFORCE++: clipped reward at the last token, per-token k1 KL, return-to-go, global whitening."""

import math

import torch

from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.reinforce_pp import ReinforcePP, ReinforcePPConfig

MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def rollout():
    return Rollout(rewards=torch.tensor([1.0, -20.0]), group=torch.tensor([0, 1]), response_mask=MASK,
                   old_logprobs=torch.full((2, 3), -1.0), ref_logprobs=torch.full((2, 3), -1.2), max_new_tokens=3)


def test_defaults():
    algo = ReinforcePP()
    c = algo.config
    assert (c.kl_coef, c.gamma, c.reward_clip, c.clip_low, c.clip_high) == (0.01, 1.0, 10.0, 0.2, 0.2)
    assert algo.loss_agg_mode == "token-mean" and algo.requires_reference
    assert not ReinforcePP(ReinforcePPConfig(kl_coef=0.0)).requires_reference


def test_advantages_are_whitened_returns_to_go():
    adv, returns = ReinforcePP().advantages(rollout())
    kl = 0.01 * 0.2  # beta * (log pi_old - log pi_ref) per token
    # rewards: row 0 [-kl, -kl, 1 - kl]; row 1 [-kl, -10 - kl] (R clipped to -10)
    g = [1 - 3 * kl, 1 - 2 * kl, 1 - kl, -10 - 2 * kl, -10 - kl]
    mean = sum(g) / 5
    std = math.sqrt(sum((x - mean) ** 2 for x in g) / 5)  # biased, over the 5 tokens
    w = [(x - mean) / std for x in g]
    torch.testing.assert_close(adv, torch.tensor([[w[0], w[1], w[2]], [w[3], w[4], 0.0]]))
    assert returns is None


def test_loss_is_the_clipped_surrogate():
    algo = ReinforcePP()
    r = rollout()
    adv, _ = algo.advantages(r)
    logprobs = torch.full((2, 3), -1.0 + math.log(1.5))  # ratio 1.5: A > 0 clipped at 1.2, A < 0 not
    per_token, _ = algo.loss(r.minibatch(torch.arange(2), logprobs=logprobs, advantages=adv))
    expected = torch.where(adv > 0, -adv * 1.2, -adv * 1.5) * MASK
    torch.testing.assert_close(per_token * MASK, expected)
