"""λ-GRPO: G softmax(h^λ) weights on each response's surrogate, λ learnable."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.lambda_grpo import LambdaGRPO, LambdaGRPOConfig

LENGTHS = [1, 2, 3, 6]
MASK = torch.tensor([[1] * n + [0] * (6 - n) for n in LENGTHS])
ROLLOUT = Rollout(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group=torch.zeros(4, dtype=torch.long),
                  response_mask=MASK, old_logprobs=torch.full((4, 6), -1.0), max_new_tokens=6)
RATIO = 1.1  # inside the clip for every token


def expected_weights(lam, r=1 / 9):
    # z with population std: mean 3, std sqrt((4 + 1 + 0 + 9) / 4)
    z = [(n - 3) / math.sqrt(3.5) for n in LENGTHS]
    g = [(1 + r * zi) ** lam for zi in z]
    total = sum(math.exp(x) for x in g)
    return [4 * math.exp(x) / total for x in g], g, [math.log(1 + r * zi) for zi in z]


def step(algo):
    adv, _ = algo.advantages(ROLLOUT)
    logprobs = torch.full((4, 6), -1.0 + math.log(RATIO))
    per_token, metrics = algo.loss(ROLLOUT.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    return aggregate(per_token, MASK, algo.loss_agg_mode), adv[:, 0], metrics


def test_lambda_zero_is_the_token_level_loss():
    algo = LambdaGRPO()
    assert algo.config.lambda_init == 0.0 and algo.extra_parameters() == [algo.lam]
    assert algo.requires_whole_groups and algo.loss_agg_mode == "token-mean"
    loss, adv, _ = step(algo)
    # uniform weights: sum_i sum_t (-A_i r) / sum_i |o_i|
    expected = sum(-a * RATIO * n for a, n in zip(adv.tolist(), LENGTHS)) / sum(LENGTHS)
    assert loss.item() == pytest.approx(expected, rel=1e-6)


def test_weights_and_lambda_gradient_match_the_formula():
    algo = LambdaGRPO(LambdaGRPOConfig(lambda_init=1.5))
    batch = ROLLOUT.minibatch(torch.arange(4), logprobs=torch.zeros(4, 6), advantages=torch.zeros(4, 6))
    weights, g, log_h = expected_weights(1.5)
    torch.testing.assert_close(algo.surrogate_weights(batch), torch.tensor(weights))
    assert weights[3] > weights[0]  # lambda > 0 favours long responses
    loss, adv, metrics = step(algo)
    seq = [-a * RATIO * n / sum(LENGTHS) for a, n in zip(adv.tolist(), LENGTHS)]  # c_i: per-response share
    assert loss.item() == pytest.approx(sum(w * c for w, c in zip(weights, seq)), rel=1e-6)
    loss.backward()
    # d f_i / d lambda = f_i (g'_i - sum_j s_j g'_j), g'_i = h_i^lambda log h_i, s = softmax
    dg = [gi * lh for gi, lh in zip(g, log_h)]
    mean_dg = sum(w / 4 * d for w, d in zip(weights, dg))
    expected = sum(c * w * (d - mean_dg) for c, w, d in zip(seq, weights, dg))
    assert algo.lam.grad.item() == pytest.approx(expected, rel=1e-5)
    assert metrics["actor/lambda"].item() == 1.5


def test_negative_lambda_favours_short_responses():
    batch = ROLLOUT.minibatch(torch.arange(4), logprobs=torch.zeros(4, 6), advantages=torch.zeros(4, 6))
    w = LambdaGRPO(LambdaGRPOConfig(lambda_init=-2.0)).surrogate_weights(batch)
    assert w.sum().item() == pytest.approx(4.0) and w[0] > w[1] > w[2] > w[3]


def test_lift_is_clamped_positive():
    # r = 1: 1 + z < 0 for the shortest response; the clamp keeps h^lambda defined.
    batch = ROLLOUT.minibatch(torch.arange(4), logprobs=torch.zeros(4, 6), advantages=torch.zeros(4, 6))
    w = LambdaGRPO(LambdaGRPOConfig(lambda_init=-0.5, lift=1.0)).surrogate_weights(batch)
    assert torch.isfinite(w).all() and w.sum().item() == pytest.approx(4.0)
