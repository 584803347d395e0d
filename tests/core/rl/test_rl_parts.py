"""Shared RL parts against hand-computed values of their formulas."""

import math

import pytest
import torch

from alignflow.core.rl.parts import (
    advantage_metrics,
    clipped_surrogate,
    discounted_returns,
    gae,
    group_normalize,
    kl_estimate,
    last_token_rewards,
    leave_one_out,
    masked_whiten,
)


def test_group_normalize_uses_unbiased_std():
    # mean 0.5; unbiased var = 4 * 0.25 / 3 = 1/3
    adv = group_normalize(torch.tensor([1.0, 0.0, 0.0, 1.0]), torch.tensor([0, 0, 0, 0]))
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    torch.testing.assert_close(adv, torch.tensor([expected, -expected, -expected, expected]))


def test_group_normalize_groups_are_independent_and_ids_arbitrary():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.2, 0.1, 0.1, 0.1])
    group = torch.tensor([7, 7, 7, 7, 3, 3, 3, 3])
    centred = group_normalize(rewards, group, scale=False)
    torch.testing.assert_close(centred, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.075, -0.025, -0.025, -0.025]))
    # Difficulty bias: std 0.5 and std 0.05 give the same scaled advantages [1.5, -0.5, -0.5, -0.5].
    scaled = group_normalize(rewards, group)
    torch.testing.assert_close(scaled[:4], scaled[4:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(scaled[:4], torch.tensor([1.5, -0.5, -0.5, -0.5]), atol=1e-4, rtol=1e-4)


def test_group_normalize_single_response_and_equal_rewards_give_zero():
    adv = group_normalize(torch.tensor([1.0, 1.0, 1.0, 5.0]), torch.tensor([0, 0, 0, 1]))
    torch.testing.assert_close(adv, torch.zeros(4))


def test_leave_one_out():
    adv = leave_one_out(torch.tensor([1.0, 0.0, 0.0, 1.0, 3.0]), torch.tensor([0, 0, 0, 0, 1]))
    # A_0 = 1 - (0 + 0 + 1)/3; A_1 = 0 - (1 + 0 + 1)/3; alone in its group: 0
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0.0]))


def test_masked_whiten_is_token_weighted_with_biased_variance():
    values = torch.tensor([[1.0, 2.0, 9.0], [3.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid tokens 1, 2, 3: mean 2, biased var (1 + 0 + 1)/3
    s = math.sqrt(2 / 3)
    torch.testing.assert_close(masked_whiten(values, mask), torch.tensor([[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]]))
    torch.testing.assert_close(masked_whiten(values, mask, shift_mean=False)[0, :2], torch.tensor([1 / s, 2 / s]))


def test_kl_estimators():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    log_rho = math.log(0.25 / 0.5)
    torch.testing.assert_close(kl_estimate(logp, ref, "k1"), torch.tensor([-log_rho]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k2"), torch.tensor([0.5 * log_rho**2]))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3"), torch.tensor([0.5 - 1 - log_rho]))
    with pytest.raises(ValueError, match="k1, k2 or k3"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_clamped():
    logp, ref = torch.tensor([0.0, -30.0]), torch.tensor([-30.0, 0.0])
    assert kl_estimate(logp, ref, "k1").tolist() == [10.0, -10.0]
    assert kl_estimate(logp, ref, "k3").tolist() == [10.0, 10.0]  # 19 and e^20 - 21 before the clamp
    assert torch.isfinite(kl_estimate(logp, ref, "k3")).all()


def test_clipped_surrogate_asymmetric_clip_and_gradient():
    ratios = torch.tensor([1.5, 0.9, 0.5, 1.1])
    logp = ratios.log().requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, ratio, flags = clipped_surrogate(logp, torch.zeros(4), adv, clip_low=0.2, clip_high=0.28)
    # max(-A r, -A clip(r, 0.8, 1.28))
    torch.testing.assert_close(loss, torch.tensor([-1.28, -0.9, 0.8, 1.1]))
    torch.testing.assert_close(ratio, ratios)
    assert flags["clip_high"].tolist() == [True, False, False, False]
    assert flags["clip_low"].tolist() == [False, False, True, False]
    loss.sum().backward()
    # d(-A r)/dlogp = -A r where unclipped; zero where the clip is active
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.9, 0.0, 1.1]))


def test_dual_clip_bounds_negative_advantage_loss():
    logp = torch.tensor([math.log(5.0), math.log(5.0)])
    loss, _, flags = clipped_surrogate(logp, torch.zeros(2), torch.tensor([-1.0, 1.0]), dual_clip=3.0)
    # A < 0: min(max(5, 1.2), 3) = 3; A > 0 untouched: max(-5, -1.2) = -1.2
    torch.testing.assert_close(loss, torch.tensor([3.0, -1.2]))
    assert flags["dual_clip"].tolist() == [True, False]


def test_last_token_rewards():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 1, 1]])
    out = last_token_rewards(torch.tensor([2.0, 3.0, 4.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 3.0], [0.0, 0.0, 4.0]]))


def test_gae_matches_recursion():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7], [0.2, 0.4, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=0.95)
    # row 0: delta = [0.1, 0.1, 0.3]; A2 = 0.3, A1 = 0.1 + 0.95*0.3, A0 = 0.1 + 0.95*A1
    a1 = 0.1 + 0.95 * 0.3
    a0 = 0.1 + 0.95 * a1
    # row 1: V past the end is 0: delta1 = 1 - 0.4, delta0 = 0.4 - 0.2
    b0 = 0.2 + 0.95 * 0.6
    torch.testing.assert_close(adv, torch.tensor([[a0, a1, 0.3], [b0, 0.6, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[a0 + 0.5, a1 + 0.6, 1.0], [b0 + 0.2, 1.0, 0.0]]))


def test_gae_skips_the_environments_tokens_between_model_turns():
    """A prompt token, turn 1 (2 tokens), the environment's reply (3 tokens), turn 2 (2 tokens): the model's
    tokens get the advantages and returns of the same episode with the reply left out, the reply none."""
    model = torch.tensor([[0, 1, 1, 0, 0, 0, 1, 1]])
    rewards = torch.tensor([[0.0, 0.0, 0.2, 7.0, 7.0, 7.0, 0.0, 1.0]])  # the reply's "rewards" must not count
    values = torch.tensor([[0.5, 0.5, 0.6, 9.0, 9.0, 9.0, 0.7, 0.1]])
    keep = model[0].bool()
    for gamma, lam in ((1.0, 0.95), (0.9, 0.7)):
        compact_adv, compact_ret = gae(rewards[:, keep], values[:, keep], torch.ones(1, 4), gamma, lam)
        adv, ret = gae(rewards, values, model, gamma, lam)
        torch.testing.assert_close(adv[0, keep], compact_adv[0])
        torch.testing.assert_close(ret[0, keep], compact_ret[0])
        assert adv[0, ~keep].abs().sum() == 0 and ret[0, ~keep].abs().sum() == 0


def test_gae_with_discount():
    adv, _ = gae(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.5, 0.5]]), torch.ones(1, 2), gamma=0.9, lam=0.5)
    # delta1 = 1 - 0.5; delta0 = 0 + 0.9*0.5 - 0.5; A0 = delta0 + 0.9*0.5*delta1
    torch.testing.assert_close(adv, torch.tensor([[-0.05 + 0.45 * 0.5, 0.5]]))


def test_discounted_returns():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    torch.testing.assert_close(discounted_returns(rewards, mask), torch.tensor([[3.0, 2.0, 2.0, 0.0]]))
    # G2 = 2, G1 = 0.9 * 2, G0 = 1 + 0.9 * 1.8
    torch.testing.assert_close(discounted_returns(rewards, mask, 0.9), torch.tensor([[2.62, 1.8, 2.0, 0.0]]))


def test_advantage_metrics_ignore_padding():
    m = advantage_metrics(torch.tensor([[1.0, -1.0, 50.0]]), torch.tensor([[1, 1, 0]]))
    assert (m["advantages/mean"].item(), m["advantages/std"].item()) == (0.0, 1.0)
    assert (m["advantages/min"].item(), m["advantages/max"].item()) == (-1.0, 1.0)
