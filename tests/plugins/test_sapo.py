"""SAPO: gate f(r) = sigmoid(tau (r - 1)) 4 / tau, tau by the advantage's sign; f'(1) = 1."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import PolicyBatch, Rollout
from alignflow.core.rl.parts import clipped_surrogate
from alignflow.plugins.sapo import SAPO, SAPOConfig, sapo_gate

RATIOS = torch.tensor([0.5, 1.0, 1.5, 3.0])


def sigmoid(x):
    return 1 / (1 + math.exp(-x))


def batch(ratios, advantages, mask=None, ref=None):
    """Rows of tokens with these ratios (log pi_old = -1) and advantages; log pi is the grad leaf."""
    old = torch.full(ratios.shape, -1.0)
    logprobs = (old + ratios.log()).requires_grad_(True)
    mask = torch.ones_like(ratios) if mask is None else mask
    return PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=advantages, response_mask=mask,
                       group=torch.zeros(ratios.shape[0], dtype=torch.long), ref_logprobs=ref)


def test_defaults_follow_the_paper():
    algo = SAPO()
    c = algo.config
    assert (c.tau_pos, c.tau_neg, c.kl_loss_coef, c.scale_rewards) == (1.0, 1.05, 0.0, True)
    assert algo.loss_agg_mode == "seq-mean-token-mean" and not algo.requires_reference
    assert SAPO(SAPOConfig(kl_loss_coef=0.1)).requires_reference


def test_advantages_are_grpo_group_advantages():
    r = Rollout(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group=torch.zeros(4, dtype=torch.long),
                response_mask=torch.ones(4, 2), old_logprobs=torch.zeros(4, 2), max_new_tokens=2)
    adv, returns = SAPO().advantages(r)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean 0.5, unbiased std sqrt(1/3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a])[:, None].expand(4, 2))
    assert returns is None


def test_gate_values_for_both_signs():
    # Per-token loss is -f(r) A; with A = +1 it is -f_pos(r), with A = -1 it is +f_neg(r).
    b = batch(torch.stack([RATIOS, RATIOS]), torch.tensor([[1.0], [-1.0]]).expand(2, 4))
    per_token, _ = SAPO().loss(b)
    f_pos = torch.tensor([
        4 * 0.3775407,  # 4 sigmoid(-0.5) = 1.5101627
        2.0,  # 4 sigmoid(0) = 2
        4 * 0.6224593,  # 4 sigmoid(0.5) = 2.4898373
        4 * 0.8807971,  # 4 sigmoid(2) = 3.5231883
    ])
    f_neg = torch.tensor([
        0.3716838 * 4 / 1.05,  # sigmoid(1.05 * -0.5) 4 / 1.05 = 1.4159383
        2 / 1.05,  # 1.9047619
        0.6283162 * 4 / 1.05,  # sigmoid(0.525) 4 / 1.05 = 2.3935855
        0.8909032 * 4 / 1.05,  # sigmoid(2.1) 4 / 1.05 = 3.3939169
    ])
    torch.testing.assert_close(per_token.detach(), torch.stack([-f_pos, f_neg]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(sapo_gate(RATIOS, 1.05), f_neg, rtol=1e-6, atol=1e-6)
    # A = 0 falls on the tau_neg side, as TRL and verl; its loss is 0 either way.
    assert SAPO().loss(batch(RATIOS[None], torch.zeros(1, 4)))[0].abs().sum().item() == 0.0


def test_on_policy_gradient_is_the_plain_policy_gradient():
    # d(-f(r) A)/dlog pi = -A f'(r) r, f'(r) = 4 s (1 - s); at r = 1: s = 1/2, f' = 1, so -A for either tau.
    b = batch(torch.ones(2, 1), torch.tensor([[2.0], [-3.0]]))
    SAPO().loss(b)[0].sum().backward()
    torch.testing.assert_close(b.logprobs.grad, torch.tensor([[-2.0], [3.0]]))


def test_gradient_decays_smoothly_off_policy():
    b = batch(torch.stack([RATIOS, RATIOS]), torch.tensor([[1.0], [-1.0]]).expand(2, 4))
    SAPO().loss(b)[0].sum().backward()
    grad = b.logprobs.grad
    # A = +1, tau 1: -4 s (1 - s) r
    expected_pos = torch.tensor([
        -0.9400148 * 0.5,  # s = sigmoid(-0.5): 4 * 0.3775407 * 0.6224593 = 0.9400148
        -1.0,  # r = 1
        -0.9400148 * 1.5,  # sech^2 is even in r - 1
        -0.4199743 * 3.0,  # 4 * 0.8807971 * 0.1192029 = 0.4199743
    ])
    # A = -1, tau 1.05: +4 s (1 - s) r, s = sigmoid(1.05 (r - 1))
    expected_neg = torch.tensor([0.9341398 * 0.5, 1.0, 0.9341398 * 1.5, 0.3887788 * 3.0])
    torch.testing.assert_close(grad, torch.stack([expected_pos, expected_neg]), rtol=1e-5, atol=1e-6)
    # tau_neg > tau_pos: a negative token's weight f'(r) fades faster off-policy
    weight = (grad / RATIOS).abs()
    assert (weight[1, [0, 2, 3]] < weight[0, [0, 2, 3]]).all()
    # far off-policy the weight on grad log pi vanishes: r f'(r) at r = 10 is 10 * 4 s (1 - s), s = sigmoid(9)
    far = batch(torch.tensor([[10.0]]), torch.ones(1, 1))
    SAPO().loss(far)[0].sum().backward()
    assert far.logprobs.grad.item() == pytest.approx(-10 * 4 * sigmoid(9) * (1 - sigmoid(9)), rel=1e-3)  # -0.0049, fp32


def test_no_hard_cut_where_ppo_clips():
    # A = +1 just past PPO's 1 + 0.2: PPO's gradient is 0, SAPO's is -f'(1.25) 1.25.
    r = torch.tensor([[1.25]])
    b = batch(r, torch.ones(1, 1))
    ppo_loss, _, flags = clipped_surrogate(b.logprobs, b.old_logprobs, b.advantages)
    assert flags["clip_high"].item()
    assert torch.autograd.grad(ppo_loss.sum(), b.logprobs)[0].item() == 0.0
    SAPO().loss(b)[0].sum().backward()
    s = sigmoid(0.25)
    assert b.logprobs.grad.item() == pytest.approx(-4 * s * (1 - s) * 1.25, rel=1e-6)  # -1.2306


def test_sequence_mean_aggregation():
    # Row 0: A = +1, 2 tokens at r = 1 (f = 2); row 1: A = -1, 1 token at r = 1 (f = 2 / 1.05) and a pad.
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    b = batch(torch.ones(2, 2), torch.tensor([[1.0], [-1.0]]) * mask, mask)
    algo = SAPO()
    per_token, metrics = algo.loss(b)
    loss = aggregate(per_token, mask, algo.loss_agg_mode)
    # (1/2) [(-2 - 2) / 2 + (2 / 1.05) / 1] = (1/2)(-2 + 1.9047619) = -0.0476190
    assert loss.item() == pytest.approx(0.5 * (-2 + 2 / 1.05), abs=1e-6)
    loss.backward()
    # d/dlog pi = -A f'(1) / (G |o_i|) = -1/4, -1/4 | +1/2, 0
    torch.testing.assert_close(b.logprobs.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.0]]))
    assert metrics["actor/gate_weight_mean"].item() == pytest.approx(1.0)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(1.0)


def test_kl_term():
    algo = SAPO(SAPOConfig(kl_loss_coef=0.1))
    b = batch(torch.ones(1, 2), torch.ones(1, 2), ref=torch.full((1, 2), -1.5))
    per_token, metrics = algo.loss(b)
    k3 = math.exp(-0.5) - 1 + 0.5  # log rho = log pi_ref - log pi = -0.5
    torch.testing.assert_close(per_token.detach(), torch.full((1, 2), -2.0 + 0.1 * k3))
    assert metrics["actor/kl_ref"].item() == pytest.approx(k3)
