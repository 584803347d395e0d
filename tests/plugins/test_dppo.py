"""DPPO: tokens that leave a TV or KL trust region around the sampling policy are masked; the rest get the
detached, truncated IS weight min(pi / mu, C)."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import PolicyBatch
from alignflow.plugins.dppo import DPPO, DPPOConfig, binary_kl, trust_region_mask
from helpers.rollouts import make_rollout

# Row 0 (A = +1): mu 0.5, 0.5, 0.05, 0.9 -> pi 0.5, 0.8, 0.2, 0.3
#   p - p_mu = 0, +0.3 (past 0.2), +0.15, -0.6 (against A: never masked); ratios 1, 1.6, 4 (> C = 3), 1/3
# Row 1 (A = -1): mu 0.5, 0.9 -> pi 0.2, 0.85, two pads
#   p - p_mu = -0.3 (below -0.2), -0.05; ratios 0.4, 0.85 / 0.9
MU = torch.tensor([[0.5, 0.5, 0.05, 0.9], [0.5, 0.9, 0.5, 0.5]]).log()
PI = torch.tensor([[0.5, 0.8, 0.2, 0.3], [0.2, 0.85, 0.5, 0.5]]).log()
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
ADV = torch.tensor([1.0, -1.0])[:, None] * MASK
R = 0.85 / 0.9


def run(config=None, old=MU, sampler=MU):
    algo = DPPO(config)
    logprobs = PI.clone().requires_grad_(True)
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=ADV, response_mask=MASK,
                        group=torch.zeros(2, dtype=torch.long), sampler_logprobs=sampler)
    per_token, metrics = algo.loss(batch)
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    return loss, logprobs.grad, metrics


def test_defaults():
    c = DPPOConfig()
    assert (c.divergence, c.anchor, c.is_cap, c.kl_loss_coef, c.loss_agg_mode) == ("tv", "rollout", 3.0, 0.0,
                                                                                    "token-mean")
    assert c.deltas() == (0.2, 0.2) and DPPOConfig(divergence="kl").deltas() == (0.05, 0.05)
    assert DPPOConfig(divergence="kl", delta_high=0.1).deltas() == (0.05, 0.1)
    assert not DPPO().requires_reference and DPPO(DPPOConfig(kl_loss_coef=0.1)).requires_reference


def test_advantages_are_grpo_group_advantages():
    adv, returns = DPPO().advantages(make_rollout())
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)  # rewards 1, 0, 0, 1: mean 0.5, unbiased std sqrt(1/3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, -a, a])[:, None].expand(4, 4))
    assert returns is None


def test_binary_tv_mask_loss_and_gradient():
    loss, grad, metrics = run()
    # kept: row 0 tokens 0, 2, 3 with w = 1, min(4, 3) = 3, 1/3; row 1 token 1 with w = 0.85 / 0.9
    # loss = (1/6) sum -M w A log pi
    expected = (-(1 * math.log(0.5) + 3 * math.log(0.2) + (1 / 3) * math.log(0.3)) + R * math.log(0.85)) / 6
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert loss.item() == pytest.approx(0.961549, abs=1e-5)  # (5.922785 - 0.153490) / 6
    # d/dlog pi = -M w A / 6 (w detached)
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, 0.0, -3 / 6, -1 / 18], [0.0, R / 6, 0.0, 0.0]]))
    assert metrics["actor/trust_region_masked_frac"].item() == pytest.approx(2 / 6)
    assert metrics["actor/is_capped_frac"].item() == pytest.approx(1 / 6)
    assert metrics["actor/ratio_mean"].item() == pytest.approx((1 + 1.6 + 4 + 1 / 3 + 0.4 + R) / 6, rel=1e-6)


def test_binary_kl_mask():
    # D = KL(Bern(p_mu) || Bern(p)) by hand:
    d_up = 0.5 * math.log(0.5 / 0.8) + 0.5 * math.log(0.5 / 0.2)  # 0.2231 (row 0 token 1, p > p_mu, A > 0)
    d_small = 0.05 * math.log(0.05 / 0.2) + 0.95 * math.log(0.95 / 0.8)  # 0.0939 (row 0 token 2, p > p_mu)
    d_keep = 0.9 * math.log(0.9 / 0.85) + 0.1 * math.log(0.1 / 0.15)  # 0.0109 (row 1 token 1, < 0.05)
    d = binary_kl(MU.exp(), PI.exp())
    assert d[0, 1].item() == pytest.approx(d_up, rel=1e-5) and d[1, 0].item() == pytest.approx(d_up, rel=1e-5)
    assert d[0, 2].item() == pytest.approx(d_small, rel=1e-5)
    assert d[1, 1].item() == pytest.approx(d_keep, rel=1e-4)
    _, grad, metrics = run(DPPOConfig(divergence="kl"))
    # delta 0.05 nats: row 0 token 2 (inside TV's 0.2) now leaves the region too; row 0 token 3 moves against
    # A (p < p_mu), so it stays whatever its D
    torch.testing.assert_close(grad, torch.tensor([[-1 / 6, 0.0, 0.0, -1 / 18], [0.0, R / 6, 0.0, 0.0]]))
    assert metrics["actor/trust_region_masked_frac"].item() == pytest.approx(3 / 6)


def test_untruncated_weight():
    _, grad, metrics = run(DPPOConfig(is_cap=None))
    assert grad[0, 2].item() == pytest.approx(-4 / 6)  # w = r = 4
    assert "actor/is_capped_frac" not in metrics


def test_anchor_rollout_versus_recompute():
    # pi_old recomputed equals pi_theta (one update in), the sampler's mu differs: the paper's anchor mu masks
    # as above; verl's anchor pi_old sees ratio 1 and masks nothing, d/dlog pi = -A / 6 on every token.
    _, rollout_grad, _ = run(old=PI)
    _, grad, metrics = run()
    torch.testing.assert_close(rollout_grad, grad)
    _, grad, metrics = run(DPPOConfig(anchor="recompute"), old=PI)
    torch.testing.assert_close(grad, -ADV / 6)
    assert metrics["actor/trust_region_masked_frac"].item() == 0.0
    # without the sampler's log-probs the rollout anchor falls back to old_logprobs
    _, grad, _ = run(old=PI, sampler=None)
    torch.testing.assert_close(grad, -ADV / 6)


def test_the_mask_is_decided_in_the_inputs_precision():
    """float64 log-probs of p = 0.7 + 1e-8 against p_mu = 0.5, A > 0: p - p_mu = 0.20000001 > delta 0.2, so the
    token left the trust region; computed in float32 (as before) p - p_mu rounds to 0.19999999 and it was kept."""
    f64 = torch.float64
    logprobs = torch.tensor([[math.log(0.7 + 1e-8)]], dtype=f64)
    anchor, adv = torch.tensor([[math.log(0.5)]], dtype=f64), torch.ones(1, 1, dtype=f64)
    assert trust_region_mask(logprobs, anchor, adv, "tv", 0.2, 0.2).item()
    assert not trust_region_mask(logprobs.float(), anchor.float(), adv, "tv", 0.2, 0.2).item()  # float32 flips it
    # the loss: now 0; kept (before) it was -min(r, 3) A log p = 1.4 x -ln 0.7 = 0.499345
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=anchor, advantages=adv, response_mask=torch.ones(1, 1),
                        group=torch.zeros(1, dtype=torch.long), sampler_logprobs=anchor)
    loss, metrics = DPPO().loss(batch)
    assert loss.item() == 0.0 and metrics["actor/trust_region_masked_frac"].item() == 1.0
    assert 1.4 * -math.log(0.7) == pytest.approx(0.499345, abs=1e-6)
