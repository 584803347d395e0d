"""RLOO: leave-one-out baseline on KL-penalised sequence rewards; REINFORCE when the ratio is 1."""

import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.plugins.rloo import RLOO, RLOOConfig
from helpers.rollouts import make_rollout

LENGTHS = [1, 2, 3, 4]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])


def rollout():
    return make_rollout(mask=MASK, ref=-1.1)


def test_defaults():
    algo = RLOO()
    assert algo.config.kl_coef == 0.05 and algo.requires_reference
    assert algo.loss_agg_mode == "seq-mean-token-sum"
    assert not RLOO(RLOOConfig(kl_coef=0.0)).requires_reference


def test_leave_one_out_on_kl_penalised_rewards():
    adv, _ = RLOO().advantages(rollout())
    # R'_i = R_i - 0.05 * 0.1 * |o_i| (k1 = 0.1 per token)
    r = [1 - 0.005, -0.01, -0.015, 1 - 0.02]
    loo = [r[i] - (sum(r) - r[i]) / 3 for i in range(4)]
    torch.testing.assert_close(adv, torch.tensor(loo)[:, None] * MASK)


def test_one_epoch_is_reinforce():
    algo = RLOO(RLOOConfig(kl_coef=0.0))
    r = rollout()
    adv, _ = algo.advantages(r)
    logprobs = torch.full((4, 4), -1.0, requires_grad=True)  # ratio 1
    per_token, _ = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    aggregate(per_token, MASK, algo.loss_agg_mode).backward()
    # gradient of -(1/B) sum_i A_i sum_t log pi: -A_i / B on every token; A = [2/3, -2/3, -2/3, 2/3]
    a = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3])
    torch.testing.assert_close(logprobs.grad, -a[:, None] * MASK / 4)
