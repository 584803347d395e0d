"""Kimi k1.5 mirror descent: (r_i - r_bar - tau log pi/pi_old)^2 per sequence, gradient -2 tau x Eq. 3."""

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm, aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.kimi import Kimi, KimiConfig

LENGTHS = [2, 3, 1]
MASK = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in LENGTHS])
OLD = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -1.5, -1.0], [-3.0, 0.0, 0.0]]) * MASK
# per-token log pi - log pi_old; sequence sums: 0.1 + 0.2 = 0.3, -0.1 + 0 + 0.3 = 0.2, -0.4
DELTA = torch.tensor([[0.1, 0.2, 0.0], [-0.1, 0.0, 0.3], [-0.4, 0.0, 0.0]]) * MASK
TAU = 0.5


def rollout(rewards=(1.0, 0.0, 0.0), group=(0, 0, 0)):
    return Rollout(rewards=torch.tensor(rewards), group=torch.tensor(group), response_mask=MASK,
                   old_logprobs=OLD, max_new_tokens=3)


def step(algo, r, delta=DELTA):
    adv, returns = algo.advantages(r)
    logprobs = (r.old_logprobs + delta).clone().requires_grad_(True)
    per_token, metrics = algo.loss(r.minibatch(torch.arange(3), logprobs=logprobs, advantages=adv))
    return logprobs, per_token, metrics, adv, returns


def test_defaults_and_flags():
    algo = Kimi()
    assert algo.config.tau == 1.0 and algo.loss_agg_mode == "seq-mean-token-sum"
    assert not algo.requires_reference and not algo.requires_critic and algo.needs_old_logprobs


def test_advantage_is_reward_minus_group_mean():
    r = Rollout(rewards=torch.tensor([1.0, 0.0, 0.0, 0.5]), group=torch.tensor([3, 3, 3, 8]),
                response_mask=torch.ones(4, 2), old_logprobs=torch.zeros(4, 2), max_new_tokens=2)
    adv, returns = Kimi().advantages(r)
    # group 3: r_bar = 1/3; group 8 alone: r - r_bar = 0
    torch.testing.assert_close(adv, torch.tensor([2 / 3, -1 / 3, -1 / 3, 0.0])[:, None].expand(4, 2))
    assert returns is None


def test_loss_is_the_mean_squared_residual_per_sequence():
    algo = Kimi(KimiConfig(tau=TAU))
    logprobs, per_token, metrics, *_ = step(algo, rollout())
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    # r - r_bar = (2/3, -1/3, -1/3); tau * Delta = 0.5 * (0.3, 0.2, -0.4) = (0.15, 0.1, -0.2)
    # residuals 0.516667, -0.433333, -0.133333; squares 0.266944, 0.187778, 0.017778; mean 0.4725 / 3
    assert loss.item() == pytest.approx(0.1575, rel=1e-5)
    # per sequence, whatever its length: the sum over its tokens is its own L_i
    torch.testing.assert_close(per_token.sum(-1), torch.tensor([0.266944, 0.187778, 0.017778]), rtol=1e-4, atol=0)
    assert metrics["kimi/seq_log_ratio"].item() == pytest.approx((0.3 + 0.2 - 0.4) / 3)
    # token-mean would weigh the 3-token sequence 3x the 1-token one: not the objective
    assert aggregate(per_token, MASK, "token-mean").item() != pytest.approx(0.1575, rel=1e-3)


def test_gradient_is_minus_two_tau_times_eq3():
    algo = Kimi(KimiConfig(tau=TAU))
    logprobs, per_token, _, adv, _ = step(algo, rollout())
    aggregate(per_token, MASK, algo.loss_agg_mode).backward()
    # d/dlogp_t of (1/k) sum_i (A_i - tau Delta_i)^2 = (1/k) 2 (A_i - tau Delta_i)(-tau), each token of y_i
    # = -2 tau * (1/k) [(r_i - r_bar) - (tau/2) * 2 Delta_i] = -2 tau * (Eq. 3's coefficient of grad log pi(y_i))
    # hand: -2 * 0.5 * (0.516667, -0.433333, -0.133333) / 3 = (-0.172222, 0.144444, 0.044444)
    expected = torch.tensor([-0.172222, 0.144444, 0.044444])[:, None] * MASK
    torch.testing.assert_close(logprobs.grad, expected, rtol=1e-4, atol=1e-6)

    # Eq. 3 itself, by autograd: J = (1/k) sum_j [sg(r_j - r_bar) log pi(y_j) - (tau/2) (log pi(y_j)/pi_old(y_j))^2]
    eq3_logprobs = logprobs.detach().clone().requires_grad_(True)
    seq_logp = (eq3_logprobs * MASK).sum(-1)
    seq_ratio = ((eq3_logprobs - OLD) * MASK).sum(-1)
    centred = adv[:, 0]
    J = (centred * seq_logp - TAU / 2 * seq_ratio**2).mean()
    J.backward()
    torch.testing.assert_close(logprobs.grad, -2 * TAU * eq3_logprobs.grad)


def test_zero_gradient_at_the_mirror_descent_optimum():
    # log pi/pi_old = (r - r_bar) / tau is where the loss is 0: spread over each response's tokens
    algo = Kimi(KimiConfig(tau=TAU))
    target = torch.tensor([2 / 3, -1 / 3, -1 / 3]) / TAU
    delta = (target / torch.tensor(LENGTHS, dtype=torch.float))[:, None] * MASK
    logprobs, per_token, *_ = step(algo, rollout(), delta)
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    assert loss.item() == pytest.approx(0.0, abs=1e-10)
    assert logprobs.grad.abs().max().item() < 1e-6


def test_micro_batches_sum_to_the_step_loss():
    # rows {0, 1} and {2} as two micro-batches of one optimizer step: the sum is the whole step's mean_i L_i
    algo, r = Kimi(KimiConfig(tau=TAU)), rollout()
    adv, _ = algo.advantages(r)
    parts = [torch.tensor([0, 1]), torch.tensor([2])]
    norm = StepNorm.of([MASK[p] for p in parts])
    total = 0.0
    for rows in parts:
        per_token, _ = algo.loss(r.minibatch(rows, logprobs=(OLD + DELTA)[rows], advantages=adv))
        total += aggregate(per_token, MASK[rows], algo.loss_agg_mode, norm).item()
    assert total == pytest.approx(0.1575, rel=1e-5)
