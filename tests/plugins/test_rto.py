"""RTO: PPO whose per-token reward adds clip(beta_1 (log pi_dpo - log pi_ref), -c, c) at every response token."""

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.ppo import PPO, PPOConfig
from alignflow.plugins.rto import RTO, RTOConfig

# 2 responses x 3 tokens; the second response has 2 tokens (its third position is padding, filled with
# values that would show up if padding leaked into a reward or an advantage).
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
REF = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -1.0, -1.0]])  # log pi_ref (SFT) of the sampled tokens
# log pi_dpo - log pi_ref = [0.4, -2.0, 0.0] and [3.0, -0.6, (5.0 pad)]
DPO = REF + torch.tensor([[0.4, -2.0, 0.0], [3.0, -0.6, 5.0]])
# log pi_old - log pi_ref = [0.2, -0.4, 0.1] and [0.5, 0.0, (9.0 pad)]
OLD = REF + torch.tensor([[0.2, -0.4, 0.1], [0.5, 0.0, 9.0]])
VALUES = torch.tensor([[0.5, 0.4, 0.8], [0.2, 0.1, 7.0]])  # critic before each token
REWARDS = (1.0, 0.0)  # verifier: the first response is right

# DPO term 0.05 * (log pi_dpo - log pi_ref), clipped to +-0.05:
#   [0.02, -0.10 -> -0.05, 0.0] and [0.15 -> 0.05, -0.03, (pad) 0]
DPO_TERM = torch.tensor([[0.02, -0.05, 0.0], [0.05, -0.03, 0.0]])
# KL term -0.01 * (log pi_old - log pi_ref): [-0.002, 0.004, -0.001] and [-0.005, 0.0, (pad) 0]
KL_TERM = torch.tensor([[-0.002, 0.004, -0.001], [-0.005, 0.0, 0.0]])
# outcome R at the last token: 1 at (0, 2), 0 at (1, 1)
# r = [0.02 - 0.002, -0.05 + 0.004, 0.0 - 0.001 + 1] = [0.018, -0.046, 0.999]
#     [0.05 - 0.005, -0.03 + 0.0 + 0, 0]             = [0.045, -0.030, 0.0]
TOKEN_REWARDS = torch.tensor([[0.018, -0.046, 0.999], [0.045, -0.03, 0.0]])
# GAE, gamma 1, lambda 0.95, V = 0 past the last token (and on padding):
#   response 0: d2 = 0.999 - 0.8 = 0.199;  d1 = -0.046 + 0.8 - 0.4 = 0.354;  d0 = 0.018 + 0.4 - 0.5 = -0.082
#               A2 = 0.199;  A1 = 0.354 + 0.95 * 0.199 = 0.54305;  A0 = -0.082 + 0.95 * 0.54305 = 0.4338975
#   response 1: d1 = -0.03 + 0 - 0.1 = -0.13;  d0 = 0.045 + 0.1 - 0.2 = -0.055
#               A1 = -0.13;  A0 = -0.055 + 0.95 * -0.13 = -0.1785
ADVANTAGES = torch.tensor([[0.4338975, 0.54305, 0.199], [-0.1785, -0.13, 0.0]])
# returns = A + V: [0.9338975, 0.94305, 0.999] and [0.0215, -0.03, 0]
RETURNS = torch.tensor([[0.9338975, 0.94305, 0.999], [0.0215, -0.03, 0.0]])


def rollout(teacher=DPO, rewards=REWARDS):
    return Rollout(rewards=torch.tensor(rewards), group=torch.tensor([0, 0]), response_mask=MASK, old_logprobs=OLD,
                   ref_logprobs=REF, teacher_logprobs=teacher, values=VALUES, max_new_tokens=3)


def raw(**config):
    """RTO without advantage whitening, so that its advantages are the GAE above."""
    return RTO(RTOConfig(whiten_advantages=False, **config))


def test_defaults_follow_the_official_script():
    algo = RTO()
    c = algo.config
    assert (c.dpo_reward_scale, c.dpo_reward_clip, c.kl_coef) == (0.05, 0.05, 0.01)  # beta_1, c, beta_2
    assert (c.reward_weight, c.reward_clip) == (1.0, 10.0)
    assert (c.gamma, c.lam, c.clip_low, c.clip_high, c.value_clip, c.kl_loss_coef) == (1.0, 0.95, 0.2, 0.2, 0.2, 0.0)
    assert c.whiten_advantages and algo.loss_agg_mode == "seq-mean-token-mean"
    assert RTO.requires_teacher and algo.requires_critic and algo.requires_reference
    assert RTO(RTOConfig(kl_coef=0.0)).requires_reference  # the DPO term is a log-ratio to pi_ref anyway
    with pytest.raises(ValueError):
        RTOConfig(dpo_reward_scale=0.0)  # no DPO term is plain `ppo`


def test_token_rewards_by_hand():
    torch.testing.assert_close(raw().token_rewards(rollout()), TOKEN_REWARDS)


def test_gae_advantages_and_returns_by_hand():
    adv, returns = raw().advantages(rollout())
    torch.testing.assert_close(adv, ADVANTAGES)
    torch.testing.assert_close(returns, RETURNS)
    # whitened over the 5 response tokens, biased variance, padding stays 0
    whitened, _ = RTO().advantages(rollout())
    valid = ADVANTAGES[MASK.bool()]
    mean, std = valid.mean(), valid.std(unbiased=False)
    torch.testing.assert_close(whitened, (ADVANTAGES - mean) / std * MASK)


def test_clip_bounds_the_dpo_term():
    outcome_and_kl = TOKEN_REWARDS - DPO_TERM
    # no clip: 0.05 * [0.4, -2.0, 0.0] and 0.05 * [3.0, -0.6, (pad)]
    unclipped = raw(dpo_reward_clip=None).token_rewards(rollout())
    torch.testing.assert_close(unclipped, outcome_and_kl + torch.tensor([[0.02, -0.1, 0.0], [0.15, -0.03, 0.0]]))
    # c = 0.01: [0.01, -0.01, 0.0] and [0.01, -0.01, (pad)]
    tight = raw(dpo_reward_clip=0.01).token_rewards(rollout())
    torch.testing.assert_close(tight, outcome_and_kl + torch.tensor([[0.01, -0.01, 0.0], [0.01, -0.01, 0.0]]))
    # beta_1 = 0.5: [0.2, -1.0, 0.0] and [1.5, -0.3] all clipped to +-0.05 but the 0
    scaled = raw(dpo_reward_scale=0.5).token_rewards(rollout())
    torch.testing.assert_close(scaled, outcome_and_kl + torch.tensor([[0.05, -0.05, 0.0], [0.05, -0.05, 0.0]]))


def test_kl_term_is_k1_of_pi_old_to_pi_ref():
    no_kl = raw(kl_coef=0.0).token_rewards(rollout())
    torch.testing.assert_close(raw().token_rewards(rollout()) - no_kl, KL_TERM)
    # beta_2 = 0.1: ten times the penalty, on pi_old (the padded 9.0 never counts)
    torch.testing.assert_close(raw(kl_coef=0.1).token_rewards(rollout()) - no_kl, 10 * KL_TERM)


def test_outcome_reward_weighted_and_clipped_at_the_last_token():
    no_outcome = raw(reward_weight=0.0).token_rewards(rollout())
    torch.testing.assert_close(TOKEN_REWARDS - no_outcome, torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    # R = (25, -4): clipped to 10 at (0, 2), -4 at (1, 1); beta_3 = 0.5 after the clip: 5 and -2
    weighted = raw(reward_weight=0.5).token_rewards(rollout(rewards=(25.0, -4.0)))
    torch.testing.assert_close(weighted - no_outcome, torch.tensor([[0.0, 0.0, 5.0], [0.0, -2.0, 0.0]]))
    free = raw(reward_clip=None).token_rewards(rollout(rewards=(25.0, -4.0)))
    torch.testing.assert_close(free - no_outcome, torch.tensor([[0.0, 0.0, 25.0], [0.0, -4.0, 0.0]]))


def test_dpo_model_equal_to_reference_is_exactly_ppo():
    r = rollout(teacher=REF.clone())
    ppo = PPO(PPOConfig(kl_coef=0.01))
    assert torch.equal(RTO().token_rewards(r), ppo.token_rewards(r))
    (adv, returns), (adv_ppo, returns_ppo) = RTO().advantages(r), ppo.advantages(r)
    assert torch.equal(adv, adv_ppo) and torch.equal(returns, returns_ppo)


def test_loss_is_ppo_clip_seq_mean_token_mean_and_logs_the_dpo_term():
    algo = raw()
    r = rollout()
    adv, returns = algo.advantages(r)
    logprobs = OLD.clone().requires_grad_()  # on-policy: every ratio is 1
    per_token, metrics = algo.loss(r.minibatch(torch.arange(2), logprobs=logprobs, advantages=adv, returns=returns))
    aggregate(per_token, MASK, algo.loss_agg_mode).backward()
    # d/dlogp of (1/B) sum_i (1/|o_i|) sum_t -A_it r_it = -A_it / (|o_i| B): /6 for 3 tokens, /4 for 2 tokens
    expected = -ADVANTAGES / torch.tensor([[6.0], [4.0]])
    torch.testing.assert_close(logprobs.grad, expected)
    # clipped DPO term over the 5 tokens: (0.02 - 0.05 + 0 + 0.05 - 0.03) / 5; 2 of 5 tokens clipped
    assert metrics["rto/dpo_reward_mean"].item() == pytest.approx(-0.002, abs=1e-7)
    assert metrics["rto/dpo_reward_clip_frac"].item() == pytest.approx(0.4)
