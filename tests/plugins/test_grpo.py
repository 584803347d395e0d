"""GRPO: group mean/std advantages, clipped surrogate + beta * k3, seq-mean-token-mean."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.plugins.grpo import GRPO, GRPOConfig
from helpers.rollouts import make_rollout

LENGTHS = [2, 4, 1, 3]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])


def rollout(rewards=(1.0, 0.0, 0.0, 1.0)):
    return make_rollout(rewards, mask=MASK, ref=-1.5, max_new_tokens=8)


def test_defaults_follow_the_paper():
    algo = GRPO()
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, c.kl_loss_estimator) == (0.2, 0.2, 0.04, "k3")
    assert algo.loss_agg_mode == "seq-mean-token-mean" and algo.requires_reference
    assert not GRPO(GRPOConfig(kl_loss_coef=0.0)).requires_reference


def test_advantages_are_group_standardised():
    adv, returns = GRPO().advantages(rollout())
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # mean 0.5, unbiased std sqrt(1/3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a])[:, None] * MASK)
    assert returns is None


def test_loss_value_and_gradient_match_the_objective():
    algo, r = GRPO(), rollout()
    adv, _ = algo.advantages(r)
    logprobs = torch.full((4, 4), -1.0, requires_grad=True)  # on-policy: ratio 1
    per_token, metrics = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    k3 = math.exp(-0.5) - 1 + 0.5  # log rho = log pi_ref - log pi = -0.5
    # (1/G) sum_i (1/|o_i|) sum_t (-A_i + beta k3): the advantages cancel, the KL term stays
    assert loss.item() == pytest.approx(0.04 * k3, abs=1e-7)
    # d/dlogp: (1/G)(1/|o_i|)(-A_i + beta (1 - rho)), rho = e^-0.5
    signs = torch.tensor([1.0, -1.0, -1.0, 1.0])
    per_seq = (-a * signs + 0.04 * (1 - math.exp(-0.5))) / (4 * torch.tensor(LENGTHS, dtype=torch.float))
    torch.testing.assert_close(logprobs.grad, per_seq[:, None] * MASK)
    assert metrics["actor/kl_ref"].item() == pytest.approx(k3)


def test_length_bias_of_the_per_response_mean():
    # Two wrong answers of one group: the longer gets less push per token (1/|o_i|).
    algo = GRPO(GRPOConfig(kl_loss_coef=0.0))
    r = rollout()
    adv, _ = algo.advantages(r)
    logprobs = torch.full((4, 4), -1.0, requires_grad=True)
    aggregate(algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))[0], MASK,
              algo.loss_agg_mode).backward()
    long_wrong, short_wrong = logprobs.grad[1, 0].item(), logprobs.grad[2, 0].item()  # lengths 4 and 1
    assert long_wrong / short_wrong == pytest.approx(1 / 4)
