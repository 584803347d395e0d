"""GSPO: one length-normalised ratio per response, clipped per response; every token of a response weighs the same."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.plugins.grpo import GRPO, GRPOConfig
from alignflow.plugins.gspo import GSPO, GSPOConfig
from helpers.rollouts import make_rollout

LENGTHS = [2, 4, 1, 3]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])
A = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(1/3)
SIGNS = torch.tensor([1.0, -1.0, -1.0, 1.0])
# log(pi_theta / pi_old) per token; the padding holds junk that must not count
LOG_RATIO = torch.tensor([
    [2e-4, 4e-4, 9.0, 9.0],  # A > 0, mean 3e-4: s = e^3e-4 < 1 + 4e-4, kept
    [1e-3, -3e-3, 0.0, 0.0],  # A < 0, mean -5e-4: s < 1 - 3e-4, clipped
    [1e-3, 9.0, 9.0, 9.0],  # A < 0, s = e^1e-3 above the range, but A < 0 only clips below: kept
    [3e-3, 0.0, 0.0, 9.0],  # A > 0, mean 1e-3: s > 1 + 4e-4, clipped
], dtype=torch.float64)  # float64: the paper's ratios differ from 1 by 1e-4, float32 keeps 7 digits
OLD = torch.full((4, 4), -1.0, dtype=torch.float64)


def rollout():
    return make_rollout(mask=MASK, ref=-1.5, max_new_tokens=8, dtype=torch.float64)


def run(algo, log_ratio=LOG_RATIO):
    """Step loss, d loss / d logprobs and metrics for logprobs = old + log_ratio."""
    r = rollout()
    adv, _ = algo.advantages(r)
    logprobs = (OLD + log_ratio).requires_grad_(True)
    per_token, metrics = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    return loss, logprobs.grad, metrics


def test_defaults_follow_the_paper():
    algo = GSPO()
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, c.scale_rewards) == (3e-4, 4e-4, 0.0, True)
    assert algo.loss_agg_mode == "seq-mean-token-mean" and not algo.requires_reference
    assert GSPO(GSPOConfig(kl_loss_coef=0.1)).requires_reference


def test_loss_value_and_what_the_clip_zeroes():
    loss, grad, metrics = run(GSPO())
    s = [math.exp(3e-4), math.exp(-5e-4), math.exp(1e-3), math.exp(1e-3)]
    # (1/G) sum_i -min(s_i A_i, clip(s_i, 1 - 3e-4, 1 + 4e-4) A_i):
    #   row 0: -A s0;  row 1: A < 0, s1 = 0.9995 < 0.9997 -> +A * 0.9997;  row 2: +A s2;  row 3: -A * 1.0004
    expected = (-A * s[0] + A * (1 - 3e-4) + A * s[2] - A * (1 + 4e-4)) / 4
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    # d/dlogp_t = (1/G) (1/|o_i|) (-A_i s_i) on every token of an unclipped response, 0 on a clipped one
    per_seq = torch.tensor([-A * s[0] / (4 * 2), 0.0, A * s[2] / (4 * 1), 0.0], dtype=torch.float64)
    torch.testing.assert_close(grad, per_seq[:, None] * MASK, rtol=1e-6, atol=1e-9)
    # tokens of clipped responses: row 1 (4 tokens, A < 0) and row 3 (3 tokens, A > 0) of 10
    assert metrics["actor/clip_low_frac"].item() == pytest.approx(0.4)
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(0.3)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(sum(s) / 4, rel=1e-6)


def test_gradient_is_that_of_the_sequence_ratio():
    # The stop-gradient (GSPO-token) form must give the gradient of the paper's s_i(theta) itself (row 2:
    # A < 0, s = e^-0.3 < 0.8, clipped in both).
    log_ratio = torch.tensor([[0.3, -0.1, 0.0, 0.0], [0.2, 0.1, -0.4, 0.05], [-0.3, 0.0, 0.0, 0.0],
                              [0.1, 0.1, 0.1, 0.0]], dtype=torch.float64)
    algo = GSPO(GSPOConfig(clip_low=0.2, clip_high=0.2))
    _, grad, _ = run(algo, log_ratio)
    logprobs = (OLD + log_ratio).requires_grad_(True)
    m = MASK.double()
    s = (((logprobs - OLD) * m).sum(-1) / m.sum(-1)).exp()
    adv = A * SIGNS
    (-torch.minimum(s * adv, s.clamp(0.8, 1.2) * adv).mean()).backward()
    torch.testing.assert_close(grad, logprobs.grad * MASK)


def test_every_token_of_a_response_weighs_the_same():
    # One response, A > 0, token log-ratios +1, -1, 0: s = e^0 = 1, inside any range.
    log_ratio = torch.zeros(4, 4, dtype=torch.float64)
    log_ratio[3, :3] = torch.tensor([1.0, -1.0, 0.0])
    _, gspo, _ = run(GSPO(GSPOConfig(clip_low=0.2, clip_high=0.2)), log_ratio)
    _, grpo, _ = run(GRPO(GRPOConfig(kl_loss_coef=0.0)), log_ratio)
    # GSPO: (1/G)(1/|o|)(-A s) = -A / 12 on each of the three tokens
    torch.testing.assert_close(gspo[3, :3], torch.full((3,), -A / 12, dtype=torch.float64))
    # GRPO weighs each token by its own ratio: r = e > 1.2 is clipped (0), r = e^-1 pushes e^-1 as hard
    torch.testing.assert_close(grpo[3, :3], torch.tensor([0.0, -A * math.exp(-1) / 12, -A / 12], dtype=torch.float64))


def test_one_drifting_token_clips_the_whole_response():
    # A > 0, |o| = 3, one token at log-ratio 3e-3: s = e^1e-3 > 1 + 4e-4, so no token of it is pushed,
    # while GRPO's token ratios (e^3e-3 < 1.2) all stay inside its range.
    log_ratio = torch.zeros(4, 4, dtype=torch.float64)
    log_ratio[3, 0] = 3e-3
    _, gspo, _ = run(GSPO(), log_ratio)
    _, grpo, _ = run(GRPO(GRPOConfig(kl_loss_coef=0.0)), log_ratio)
    assert torch.all(gspo[3] == 0) and torch.all(grpo[3, :3] != 0)
    assert torch.all(gspo[0, :2] != 0)  # the other responses are untouched (on-policy, s = 1)


def test_kl_term_is_added_per_token():
    loss0, _, _ = run(GSPO())
    loss1, _, metrics = run(GSPO(GSPOConfig(kl_loss_coef=0.1)))
    # log rho = log pi_ref - log pi = -1.5 - (-1 + log r); per response mean of k3, then mean over responses
    logrho = -0.5 - LOG_RATIO
    k3 = (logrho.exp() - 1 - logrho) * MASK
    expected = 0.1 * (k3.sum(-1) / MASK.sum(-1)).mean()
    assert (loss1 - loss0).item() == pytest.approx(expected.item(), rel=1e-5)
    assert "actor/kl_ref" in metrics
