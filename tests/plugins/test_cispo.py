"""CISPO: a detached, clipped IS weight on the REINFORCE term; clipped tokens keep their gradient."""

import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import PolicyBatch
from alignflow.core.rl.parts import clipped_surrogate
from alignflow.plugins.cispo import CISPO, CISPOConfig
from alignflow.plugins.dapo import DAPO
from helpers.rollouts import make_rollout

# Two responses: A = +2 with ratios 1, 6 (past the cap 5), 0.5; A = -1 with ratios 0.1, 1.5 and one pad.
RATIOS = torch.tensor([[1.0, 6.0, 0.5], [0.1, 1.5, 1.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
ADV = torch.tensor([2.0, -1.0])[:, None] * MASK
OLD = torch.full((2, 3), -1.0)


def batch(logprobs, advantages=ADV, mask=MASK, old=OLD, ref=None):
    return PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
                       group=torch.zeros(mask.shape[0], dtype=torch.long), ref_logprobs=ref)


def leaf_logprobs(ratios=RATIOS, old=OLD):
    return (old + ratios.log()).requires_grad_(True)  # log pi = log pi_old + log r


def step_loss(algo, logprobs, **kw):
    per_token, metrics = algo.loss(batch(logprobs, **kw))
    mask = kw.get("mask", MASK)
    return aggregate(per_token, mask, algo.loss_agg_mode), metrics


def test_defaults():
    algo = CISPO()
    c = algo.config
    assert c.clip_low is None and c.clip_high == 4.0  # no floor; cap 1 + 4 = 5 = TRL's recommended epsilon_high
    assert (c.kl_loss_coef, c.scale_rewards, c.dual_clip) == (0.0, True, None)
    assert algo.loss_agg_mode == "token-mean" and not algo.requires_reference
    assert CISPO(CISPOConfig(kl_loss_coef=0.1)).requires_reference
    with pytest.raises(ValidationError, match="dual_clip"):
        CISPOConfig(dual_clip=3.0)


def test_advantages_are_grpo_group_advantages():
    r = make_rollout(mask=torch.ones(4, 2), old=0.0)
    adv, returns = CISPO().advantages(r)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean 0.5, unbiased std sqrt(1/3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a])[:, None].expand(4, 2))
    assert returns is None


def test_loss_value_and_gradient():
    logprobs = leaf_logprobs()
    loss, metrics = step_loss(CISPO(), logprobs)
    loss.backward()
    lp = (OLD + RATIOS.log()).flatten().tolist()  # -1, -1 + ln 6, -1 + ln 0.5, -1 + ln 0.1, -1 + ln 1.5
    # weights w = clip(r, -inf, 5): 1, 5, 0.5 | 0.1, 1.5; loss = (1/5) sum -w A log pi over the 5 tokens
    expected = (-2 * (1 * lp[0] + 5 * lp[1] + 0.5 * lp[2]) + 1 * (0.1 * lp[3] + 1.5 * lp[4])) / 5
    assert loss.item() == pytest.approx(expected, rel=1e-6)  # = -1.0893...
    assert loss.item() == pytest.approx(-1.089302, abs=1e-5)
    # d/dlog pi = -w A / 5: the weight is a constant (detached), so no r log pi term appears
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.4, -2.0, -0.2], [0.02, 0.3, 0.0]]))
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(1 / 5)  # the ratio-6 token
    assert metrics["actor/clip_low_frac"].item() == 0.0
    assert metrics["actor/ratio_mean"].item() == pytest.approx((1 + 6 + 0.5 + 0.1 + 1.5) / 5)


def test_clipped_tokens_keep_their_gradient_unlike_ppo():
    # One token, A = +1, ratio 6: past both PPO's 1 + 0.2 and CISPO's 1 + 4.
    old = torch.tensor([[-1.0]])
    ppo_lp = leaf_logprobs(torch.tensor([[6.0]]), old)
    ppo_loss, _, flags = clipped_surrogate(ppo_lp, old, torch.ones(1, 1))
    ppo_loss.sum().backward()
    assert flags["clip_high"].item() and ppo_lp.grad.item() == 0.0  # max(-6, -1.2) = -1.2: a constant
    lp = leaf_logprobs(torch.tensor([[6.0]]), old)
    CISPO().loss(batch(lp, torch.ones(1, 1), torch.ones(1, 1), old))[0].sum().backward()
    assert lp.grad.item() == pytest.approx(-5.0)  # -w A = -min(6, 5) * 1
    # A = -1, ratio 0.1: PPO's floor 0.8 zeroes it; CISPO has no floor, so -w A = 0.1.
    ppo_lp = leaf_logprobs(torch.tensor([[0.1]]), old)
    clipped_surrogate(ppo_lp, old, -torch.ones(1, 1))[0].sum().backward()
    assert ppo_lp.grad.item() == 0.0
    lp = leaf_logprobs(torch.tensor([[0.1]]), old)
    CISPO().loss(batch(lp, -torch.ones(1, 1), torch.ones(1, 1), old))[0].sum().backward()
    assert lp.grad.item() == pytest.approx(0.1)


def test_two_sided_clip_as_verl():
    # clip_low = clip_high = 0.2 (verl's defaults): weights clip(r, 0.8, 1.2) = 1, 1.2, 0.8 | 0.8, 1.2
    logprobs = leaf_logprobs()
    loss, metrics = step_loss(CISPO(CISPOConfig(clip_low=0.2, clip_high=0.2)), logprobs)
    loss.backward()
    # -w A / 5: -2/5, -2.4/5, -1.6/5 | 0.8/5, 1.2/5
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-0.4, -0.48, -0.32], [0.16, 0.24, 0.0]]))
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(2 / 5)  # ratios 6 and 1.5
    assert metrics["actor/clip_low_frac"].item() == pytest.approx(2 / 5)  # ratios 0.5 and 0.1


def test_on_policy_gradient_equals_token_level_grpo():
    # ratio 1 everywhere: w = 1, so d/dlog pi = -A / N, DAPO's token-mean clipped surrogate gradient.
    grads = []
    for algo in (CISPO(), DAPO()):
        logprobs = leaf_logprobs(torch.ones(2, 3))
        step_loss(algo, logprobs)[0].backward()
        grads.append(logprobs.grad)
    torch.testing.assert_close(grads[0], grads[1])
    torch.testing.assert_close(grads[0], torch.tensor([[-0.4, -0.4, -0.4], [0.2, 0.2, 0.0]]))


def test_kl_term():
    algo = CISPO(CISPOConfig(kl_loss_coef=0.1))
    ref = torch.full((2, 3), -1.5)
    logprobs = leaf_logprobs(torch.ones(2, 3))  # log pi = -1 on every token
    loss, metrics = step_loss(algo, logprobs, ref=ref)
    k3 = math.exp(-0.5) - 1 + 0.5  # log rho = log pi_ref - log pi = -0.5
    # (1/5) sum (-A log pi + 0.1 k3) = (1/5)(-2 * 3 * -1 + 1 * 2 * -1) + 0.1 k3 = 4/5 + 0.1 k3
    assert loss.item() == pytest.approx(0.8 + 0.1 * k3, rel=1e-6)
    assert metrics["actor/kl_ref"].item() == pytest.approx(k3)
