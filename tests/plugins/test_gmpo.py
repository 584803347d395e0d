"""GMPO: geometric mean of token ratios clipped in log space, pessimistically for the advantage's sign."""

import math

import pydantic
import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.gmpo import GMPO, GMPOConfig

LENGTHS = [2, 4, 1, 3]
MASK = torch.tensor([[1] * n + [0] * (4 - n) for n in LENGTHS])
A = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # rewards (1, 0, 0, 1): mean 0.5, unbiased std sqrt(1/3)
# log(pi_theta / pi_old) per token; the padding holds junk that must not count
LOG_RATIO = torch.tensor([
    [0.5, -0.6, 7.0, 7.0],  # A > 0: 0.5 -> 0.4 (clipped), -0.6 kept (a low ratio is not capped for A > 0)
    [-0.5, 0.6, 0.1, -0.2],  # A < 0: -0.5 -> -0.4 (clipped), 0.6 kept
    [0.0, 7.0, 7.0, 7.0],  # A < 0: ratio 1
    [0.3, 0.3, 0.3, 7.0],  # A > 0: all inside (e^-0.4, e^0.4)
], dtype=torch.float64)
OLD = torch.full((4, 4), -1.0, dtype=torch.float64)


def run(algo, log_ratio=LOG_RATIO, rewards=(1.0, 0.0, 0.0, 1.0)):
    """Step loss, d loss / d logprobs and metrics for logprobs = old + log_ratio."""
    r = Rollout(rewards=torch.tensor(rewards), group=torch.zeros(4, dtype=torch.long), response_mask=MASK,
                old_logprobs=OLD, ref_logprobs=torch.full((4, 4), -1.5, dtype=torch.float64), max_new_tokens=8)
    adv, _ = algo.advantages(r)
    logprobs = (OLD + log_ratio).requires_grad_(True)
    per_token, metrics = algo.loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    return loss, logprobs.grad, metrics


def test_defaults_follow_the_paper():
    algo = GMPO()
    c = algo.config
    assert (c.log_clip_low, c.log_clip_high, c.kl_loss_coef, c.scale_rewards) == (0.4, 0.4, 0.0, True)
    assert algo.loss_agg_mode == "seq-mean-token-mean" and not algo.requires_reference
    assert GMPO(GMPOConfig(kl_loss_coef=0.1)).requires_reference
    with pytest.raises(pydantic.ValidationError):  # GRPO's ratio-space names are refused, not reinterpreted
        GMPOConfig(clip_low=0.2)


def test_loss_value_and_gradient():
    loss, grad, metrics = run(GMPO())
    # kept log-ratios and their means: row 0 (0.4, -0.6) -> -0.1; row 1 (-0.4, 0.6, 0.1, -0.2) -> 0.1 / 4;
    # row 2 (0) -> 0; row 3 (0.3, 0.3, 0.3) -> 0.3. loss_i = -A_i exp(mean), then the mean over responses.
    g = [math.exp(-0.1), math.exp(0.025), 1.0, math.exp(0.3)]
    assert loss.item() == pytest.approx((-A * g[0] + A * g[1] + A * g[2] - A * g[3]) / 4, rel=1e-6)
    # d loss_i / d logp_t = -A_i g_i / |o_i| for a kept token, 0 for a clipped one; times 1/G
    expected = torch.tensor([
        [0.0, -A * g[0] / 2, 0, 0],
        [0.0, A * g[1] / 4, A * g[1] / 4, A * g[1] / 4],
        [A * g[2], 0, 0, 0],
        [-A * g[3] / 3] * 3 + [0],
    ], dtype=torch.float64) / 4
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-12)
    # 1 of 10 tokens clipped on each side: row 0's 0.5 (A > 0) and row 1's -0.5 (A < 0)
    assert metrics["actor/clip_high_frac"].item() == pytest.approx(0.1)
    assert metrics["actor/clip_low_frac"].item() == pytest.approx(0.1)
    assert metrics["actor/ratio_mean"].item() == pytest.approx(sum(g) / 4, rel=1e-6)


def test_geometric_mean_damps_an_outlier_token():
    # A > 0, |o| = 3, log-ratios (3, 0, 0) with the clip opened wide: the geometric mean is e^1 and every
    # token gets the same weight A e / 3; GRPO's arithmetic mean would weight the outlier e^3 = 20 times more.
    log_ratio = torch.zeros(4, 4, dtype=torch.float64)
    log_ratio[3, 0] = 3.0
    _, grad, _ = run(GMPO(GMPOConfig(log_clip_low=10.0, log_clip_high=10.0)), log_ratio)
    torch.testing.assert_close(grad[3, :3], torch.full((3,), -A * math.e / 3 / 4, dtype=torch.float64))


def test_zero_advantage_gives_no_loss():
    loss, grad, _ = run(GMPO(), rewards=(1.0, 1.0, 1.0, 1.0))  # every advantage 0, whatever the ratios
    assert loss.item() == 0.0 and torch.all(grad == 0)


def test_kl_term_is_a_per_response_mean():
    loss0, _, _ = run(GMPO())
    loss1, _, metrics = run(GMPO(GMPOConfig(kl_loss_coef=0.1)))
    logrho = -0.5 - LOG_RATIO  # log pi_ref - log pi = -1.5 - (-1 + log r)
    k3 = (logrho.exp() - 1 - logrho) * MASK
    assert (loss1 - loss0).item() == pytest.approx(0.1 * (k3.sum(-1) / MASK.sum(-1)).mean().item(), rel=1e-6)
    assert "actor/kl_ref" in metrics
