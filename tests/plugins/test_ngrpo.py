"""NGRPO: K virtual max-reward samples in the group statistics, asymmetric clip 0.16 / 0.24, token-mean, no KL."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.grpo import GRPO
from alignflow.plugins.ngrpo import NGRPO, NGRPOConfig

EPS = 1e-6


def rollout(rewards, group=None, correct=None, width=3):
    rewards = torch.tensor(rewards, dtype=torch.float)
    n = len(rewards)
    return Rollout(rewards=rewards, group=torch.zeros(n, dtype=torch.long) if group is None else torch.tensor(group),
                   response_mask=torch.ones(n, width), old_logprobs=torch.zeros(n, width), max_new_tokens=width,
                   correct=None if correct is None else torch.tensor(correct, dtype=torch.float))


def test_defaults_follow_the_official_script():
    algo = NGRPO()
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, c.max_reward, c.virtual_samples) == (0.16, 0.24, 0.0, 1.0, 1)
    assert algo.loss_agg_mode == "token-mean" and not algo.requires_reference
    assert not c.filter_all_correct and algo.max_gen_batches == 1


def test_all_wrong_group_gets_minus_one_third():
    # R' = {0 x 8, 1}: mu' = 1/9; sum of squares 8 (1/9)^2 + (8/9)^2 = 72/81 = 8/9, over G + K - 1 = 8: 1/9,
    # sigma' = 1/3; A = (0 - 1/9) / (1/3) = -1/3 for every response (GRPO: 0).
    adv, returns = NGRPO().advantages(rollout([0.0] * 8))
    assert returns is None
    torch.testing.assert_close(adv, torch.full((8, 3), -1 / 3 / (1 + 3 * EPS)))
    assert (GRPO().advantages(rollout([0.0] * 8))[0] == 0).all()


def test_all_correct_group_gets_zero():
    # R' = {1 x 9}: mu' = 1, sigma' = 0, A = 0 / eps = 0
    adv, _ = NGRPO().advantages(rollout([1.0] * 8))
    assert (adv == 0).all()


def test_mixed_group_is_shifted_down():
    # 2 correct of 8. R' = {1, 1, 0 x 6, 1}: mu' = 3/9 = 1/3;
    # squares 3 (2/3)^2 + 6 (1/3)^2 = 12/9 + 6/9 = 2, over 8: 1/4, sigma' = 1/2;
    # correct (1 - 1/3) / (1/2) = 4/3, wrong (0 - 1/3) / (1/2) = -2/3.
    rewards = [1.0, 0, 0, 1.0, 0, 0, 0, 0]
    adv = NGRPO().advantages(rollout(rewards))[0][:, 0]
    expected = torch.tensor([4 / 3 if r else -2 / 3 for r in rewards]) * (0.5 / (0.5 + EPS))
    torch.testing.assert_close(adv, expected)
    # GRPO on the same group: mu = 1/4, sigma = sqrt((2 (3/4)^2 + 6 (1/4)^2) / 7) = sqrt(3/14); both move down
    grpo = GRPO().advantages(rollout(rewards))[0][:, 0]
    assert grpo[0].item() == pytest.approx(0.75 / math.sqrt(3 / 14), rel=1e-5)
    assert (adv < grpo).all()


def test_groups_are_separate_and_k_is_a_knob():
    # group 0 all wrong (G = 2, K = 2): R' = {0, 0, 1, 1}, mu' = 1/2, sigma' = sqrt(4 (1/4) / 3) = 1/sqrt(3),
    # A = -(1/2) sqrt(3); group 1 all wrong, G = 8: -1/3 as above. K = 0 is GRPO's advantage.
    r = rollout([0.0, 0.0] + [0.0] * 8, group=[5, 5] + [9] * 8)
    adv = NGRPO(NGRPOConfig(virtual_samples=2)).advantages(r)[0][:, 0]
    assert adv[0].item() == pytest.approx(-0.5 * math.sqrt(3), rel=1e-5)
    sigma = math.sqrt((8 * (2 / 10) ** 2 + 2 * (8 / 10) ** 2) / 9)  # K = 2 in the G = 8 group too
    assert adv[2].item() == pytest.approx(-0.2 / sigma, rel=1e-5)
    mixed = rollout([1.0, 0, 0.5, 0])
    torch.testing.assert_close(NGRPO(NGRPOConfig(virtual_samples=0)).advantages(mixed)[0],
                               GRPO().advantages(mixed)[0])


def test_max_reward_sets_the_virtual_sample():
    # rewards {0, 1} with r_max 2: R' = {0, 1, 2}, mu' = 1, sigma' = 1: A = (-1, 0)
    adv = NGRPO(NGRPOConfig(max_reward=2.0)).advantages(rollout([0.0, 1.0]))[0][:, 0]
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0]) / (1 + EPS))


def test_asymmetric_clip_in_the_token_mean_loss():
    algo = NGRPO()
    r = rollout([1.0, 0, 0, 0, 0, 0, 0, 0], width=2)
    adv, _ = algo.advantages(r)
    # 1 correct of 8: R' = {1, 1, 0 x 7}, mu' = 2/9, squares 2 (7/9)^2 + 7 (2/9)^2 = 126/81 = 14/9, /8: 7/36
    sigma = math.sqrt(7 / 36)
    a_pos, a_neg = (7 / 9) / (sigma + EPS), (-2 / 9) / (sigma + EPS)
    assert adv[0, 0].item() == pytest.approx(a_pos) and adv[1, 0].item() == pytest.approx(a_neg)
    # ratios: row 0 (A > 0) 1.3 -> clipped at 1.24; row 1 (A < 0) 0.8 -> clipped at 0.84; row 2 0.9 inside;
    # the other rows 1.
    ratios = torch.tensor([1.3, 0.8, 0.9] + [1.0] * 5)[:, None].expand(8, 2)
    logprobs = ratios.log().clone().requires_grad_(True)
    per_token, metrics = algo.loss(r.minibatch(torch.arange(8), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, r.response_mask, algo.loss_agg_mode)
    # token-mean over 16 tokens of -A min(r, clip): 2 tokens each
    expected = 2 * (-a_pos * 1.24 - a_neg * 0.84 - a_neg * 0.9 - 5 * a_neg * 1.0) / 16
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()
    assert logprobs.grad[0].abs().sum() == 0 and logprobs.grad[1].abs().sum() == 0  # both clipped
    # row 2: d(-A r)/dlog r = -A r, / 16 tokens
    torch.testing.assert_close(logprobs.grad[2], torch.full((2,), -a_neg * 0.9 / 16))
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(2 / 16)
    assert metrics["actor/clip_low_frac"].item() == pytest.approx(2 / 16)


def test_optional_filter_drops_only_all_correct_groups():
    algo = NGRPO(NGRPOConfig(filter_all_correct=True))
    r = rollout([1.0] * 2 + [0.0] * 2 + [1.0, 0.0], group=[0, 0, 1, 1, 2, 2], correct=[1, 1, 0, 0, 1, 0])
    assert algo.filter_groups(r).tolist() == [False, False, True, True, True, True]
    assert algo.max_gen_batches == 10
    assert NGRPO().filter_groups(r).all()
    with pytest.raises(DataError, match="accuracy"):
        algo.filter_groups(rollout([1.0, 0.0]))


def test_kl_loss_is_opt_in():
    assert NGRPO(NGRPOConfig(kl_loss_coef=0.01)).requires_reference
