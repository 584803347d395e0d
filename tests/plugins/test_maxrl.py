"""MaxRL: (r - mean) / mean within a prompt's group; 0 for a group with no success."""

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.plugins.maxrl import MaxRL, MaxRLConfig, maxrl_advantages
from helpers.rollouts import make_rollout


def test_defaults():
    c = MaxRLConfig()
    assert (c.reward, c.eps, c.kl_loss_coef, c.clip_low, c.clip_high) == ("total", 0.0, 0.0, 0.2, 0.2)
    assert c.dual_clip is None  # the official code's verl dual clip at 3 is `dual_clip: 3` (see the docstring)
    assert MaxRL().loss_agg_mode == "token-mean" and not MaxRL().requires_reference


def test_advantages_by_hand():
    # groups: [1,0,0,0] mean 1/4 -> (1 - 1/4)/(1/4) = 3, (0 - 1/4)/(1/4) = -1
    #         [1,1,0]  mean 2/3 -> (1/3)/(2/3) = 0.5, (-2/3)/(2/3) = -1
    #         [0,0] no success -> 0;  [1,1] -> 0;  [1] alone: r = mean -> 0
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 0, 1, 1, 1])
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 2, 2, 3, 3, 4])
    expected = torch.tensor([3.0, -1, -1, -1, 0.5, 0.5, -1, 0, 0, 0, 0, 0])
    torch.testing.assert_close(maxrl_advantages(rewards, group), expected)


def test_one_success_in_sixteen_and_fifteen():
    # K = 1 of 16: +15 and -1 (GRPO: +3.75, -0.25); K = 15 of 16: (1 - 15/16)/(15/16) = 1/15 and -1
    one = torch.tensor([1.0] + [0.0] * 15)
    adv = maxrl_advantages(one, torch.zeros(16, dtype=torch.long))
    assert adv[0].item() == pytest.approx(15.0) and torch.all(adv[1:] == -1)
    adv = maxrl_advantages(1 - one, torch.zeros(16, dtype=torch.long))
    assert adv[1].item() == pytest.approx(1 / 15) and adv[0].item() == pytest.approx(-1.0)


def test_negative_mean_is_zeroed_and_eps():
    # mean -0.5: (r - mean)/mean would flip every sign; the group gets 0
    torch.testing.assert_close(maxrl_advantages(torch.tensor([0.0, -1.0]), torch.zeros(2, dtype=torch.long)),
                               torch.zeros(2))
    # eps = 0.25 (the official code's 1e-6, made large to show): mean 0.25 -> (1 - 0.25)/(0.25 + 0.25) = 1.5
    adv = maxrl_advantages(torch.tensor([1.0, 0, 0, 0]), torch.zeros(4, dtype=torch.long), eps=0.25)
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_rollout_advantages_use_the_chosen_reward():
    # total rewards 0.5, 0, 0, 0 (partial credit) but correct 1, 1, 0, 0
    r = make_rollout((0.5, 0.0, 0.0, 0.0), correct=torch.tensor([1.0, 1.0, 0.0, 0.0]))
    adv, returns = MaxRL().advantages(r)
    torch.testing.assert_close(adv, torch.tensor([3.0, -1, -1, -1])[:, None].expand(4, 4))
    assert returns is None
    adv, _ = MaxRL(MaxRLConfig(reward="correct")).advantages(r)  # mean 1/2: +1, -1
    torch.testing.assert_close(adv, torch.tensor([1.0, 1, -1, -1])[:, None].expand(4, 4))


def test_on_policy_loss_is_the_advantage_weighted_score():
    # ratio 1: loss = (1/N) sum -A log pi, d/dlog pi = -A / N with N = 2 + 3 + 1 + 2 = 8 tokens
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    r = make_rollout((1.0, 0.0, 0.0, 0.0), mask=mask)
    algo = MaxRL()
    adv, _ = algo.advantages(r)
    logprobs = r.old_logprobs.clone().requires_grad_(True)
    per_token, _ = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, mask, algo.loss_agg_mode)
    loss.backward()
    # surrogate value -A r = -A per token: (-3 * 2 + 1 * 3 + 1 * 1 + 1 * 2) / 8 = 0
    assert loss.item() == pytest.approx(0.0, abs=1e-7)
    torch.testing.assert_close(logprobs.grad, -torch.tensor([3.0, -1, -1, -1])[:, None] * mask / 8)
