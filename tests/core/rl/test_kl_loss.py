"""The KL-to-reference loss term (`with_kl_loss`) and the clamp settings, against hand-computed values."""

import math

import pydantic
import pytest
import torch

from alignflow.core.rl.algorithm import KLLossConfig, PolicyBatch, PolicyGradient, PolicyGradientConfig
from alignflow.core.rl.parts import clipped_surrogate, kl_estimate
from alignflow.plugins.cispo import CISPOConfig
from alignflow.plugins.gmpo import GMPO, GMPOConfig
from alignflow.plugins.grpo import GRPOConfig
from alignflow.plugins.gspo import GSPOConfig
from alignflow.plugins.sapo import SAPOConfig

F64 = torch.float64
LN2 = math.log(2.0)
# One response, two tokens: pi_theta = (0.5, 0.2), pi_old = (0.25, 0.4), pi_ref = (0.25, 0.1).
# r = pi_theta / pi_old = (2, 0.5); rho = pi_ref / pi_theta = (0.5, 0.5) on both tokens, so
# k3 = rho - 1 - log rho = 0.5 - 1 + ln 2 = 0.1931... on each.
LOGP = [math.log(0.5), math.log(0.2)]
OLD = [math.log(0.25), math.log(0.4)]
REF = [math.log(0.25), math.log(0.1)]
K3 = 0.5 - 1 + LN2


def kl_term(old=None, **config):
    """Per-token loss and d loss / d logprobs of the KL term alone (advantage 0 removes the surrogate)."""
    logprobs = torch.tensor([LOGP], dtype=F64, requires_grad=True)
    old = torch.tensor([OLD], dtype=F64) if old is None else old(logprobs)
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=old, advantages=torch.zeros(1, 2, dtype=F64),
                        response_mask=torch.ones(1, 2), group=torch.zeros(1, dtype=torch.long),
                        ref_logprobs=torch.tensor([REF], dtype=F64))
    algo = PolicyGradient(PolicyGradientConfig(kl_loss_coef=0.1, **config))
    per_token, metrics = algo.loss(batch)
    per_token.sum().backward()
    return per_token.detach(), logprobs.grad[0], metrics


def test_default_kl_term_is_unweighted_k3():
    assert KLLossConfig().kl_loss_bias_correction is False
    loss, grad, _ = kl_term()
    torch.testing.assert_close(loss[0], torch.tensor([0.1 * K3, 0.1 * K3], dtype=F64))
    # d k3 / d log pi_theta = 1 - rho = 0.5 on each token, whatever pi_old is
    torch.testing.assert_close(grad, torch.tensor([0.05, 0.05], dtype=F64))


def test_bias_corrected_kl_term_is_ratio_times_k3_per_token():
    loss, grad, metrics = kl_term(kl_loss_bias_correction=True)
    torch.testing.assert_close(loss[0], torch.tensor([0.1 * 2 * K3, 0.1 * 0.5 * K3], dtype=F64))
    # d (r k3) / d log pi_theta = r (k3 + 1 - rho) = r (log pi_theta - log pi_ref) = r ln 2: (2 ln 2, 0.5 ln 2)
    torch.testing.assert_close(grad, torch.tensor([0.1 * 2 * LN2, 0.1 * 0.5 * LN2], dtype=F64))
    torch.testing.assert_close(metrics["actor/kl_ref"], torch.tensor((2 + 0.5) * K3 / 2, dtype=F64))


def test_bias_correction_changes_the_gradient_on_policy():
    # pi_old = sg(pi_theta): r = 1 in value, so the loss is k3's; its gradient is k3 + 1 - rho = ln 2, not 0.5
    loss, grad, _ = kl_term(old=lambda logprobs: logprobs.detach(), kl_loss_bias_correction=True)
    torch.testing.assert_close(loss[0], torch.tensor([0.1 * K3, 0.1 * K3], dtype=F64))
    torch.testing.assert_close(grad, torch.tensor([0.1 * LN2, 0.1 * LN2], dtype=F64))


def test_kl_clamp_binds_from_log_rho_2_61_and_is_a_setting():
    # k3(x) = e^x - 1 - x reaches 10 at x = 2.6109 (and at x = -11.0)
    logp = torch.zeros(3, dtype=F64, requires_grad=True)
    ref = torch.tensor([2.6, 2.7, -12.0], dtype=F64)
    k3 = [math.exp(x) - 1 - x for x in (2.6, 2.7, -12.0)]  # 9.8637, 11.1797, 11.0000061
    assert k3[0] < 10 < min(k3[1:])
    clamped = kl_estimate(logp, ref, "k3")
    torch.testing.assert_close(clamped, torch.tensor([k3[0], 10.0, 10.0], dtype=F64))
    clamped.sum().backward()
    assert logp.grad[1:].tolist() == [0.0, 0.0]  # no gradient past the clamp
    torch.testing.assert_close(kl_estimate(logp, ref, "k3", clamp=None), torch.tensor(k3, dtype=F64))
    torch.testing.assert_close(kl_estimate(logp, ref, "k3", clamp=11.1), torch.tensor([k3[0], 11.1, k3[2]], dtype=F64))


def test_kl_clamp_setting_reaches_the_loss():
    # pi_ref = e^2.7 pi_theta on both tokens: k3 = 11.1797 > 10
    ref = [x + 2.7 for x in LOGP]
    logprobs = torch.tensor([LOGP], dtype=F64)
    batch = PolicyBatch(logprobs=logprobs, old_logprobs=logprobs, advantages=torch.zeros(1, 2, dtype=F64),
                        response_mask=torch.ones(1, 2), group=torch.zeros(1, dtype=torch.long),
                        ref_logprobs=torch.tensor([ref], dtype=F64))
    k3 = math.exp(2.7) - 1 - 2.7
    for kl_clamp, expected in ((10.0, 10.0), (None, k3)):
        loss, _ = PolicyGradient(PolicyGradientConfig(kl_loss_coef=1.0, kl_clamp=kl_clamp)).loss(batch)
        torch.testing.assert_close(loss[0], torch.tensor([expected, expected], dtype=F64))


def test_log_ratio_clamp_binds_past_20_and_is_a_setting():
    # A < 0 keeps the unclipped side: loss = -A r = r; log r = 21 -> e^20 with the default clamp
    logp = torch.tensor([21.0, 19.0], dtype=F64, requires_grad=True)
    old, adv = torch.zeros(2, dtype=F64), torch.full((2,), -1.0, dtype=F64)
    loss, ratio, _ = clipped_surrogate(logp, old, adv)
    torch.testing.assert_close(loss, torch.tensor([math.exp(20), math.exp(19)], dtype=F64))
    loss.sum().backward()
    assert logp.grad[0] == 0.0 and logp.grad[1] == pytest.approx(math.exp(19))
    for bound in (None, 25.0):
        loss, _, _ = clipped_surrogate(logp, old, adv, log_ratio_clamp=bound)
        torch.testing.assert_close(loss, torch.tensor([math.exp(21), math.exp(19)], dtype=F64))
    # the same bound limits log rho inside the KL estimate: k1 = -log rho = 30 -> 20 -> the KL clamp 10
    assert kl_estimate(torch.zeros(1), torch.tensor([-30.0]), "k1", clamp=None).tolist() == [20.0]
    assert kl_estimate(torch.zeros(1), torch.tensor([-30.0]), "k1", clamp=None, log_ratio_clamp=None).tolist() == [30.0]


def test_gmpo_log_ratio_clamp_setting():
    # A > 0 keeps a low token log-ratio: tokens (0, -30), geometric mean exp((0 - 20) / 2) clamped, exp(-15) not
    old = torch.zeros(1, 2, dtype=F64)
    batch = PolicyBatch(logprobs=torch.tensor([[0.0, -30.0]], dtype=F64), old_logprobs=old,
                        advantages=torch.ones(1, 2, dtype=F64), response_mask=torch.ones(1, 2),
                        group=torch.zeros(1, dtype=torch.long))
    for bound, mean_log in ((20.0, -10.0), (None, -15.0)):
        loss, _ = GMPO(GMPOConfig(log_ratio_clamp=bound)).loss(batch)
        torch.testing.assert_close(loss[0], torch.full((2,), -math.exp(mean_log), dtype=F64))


@pytest.mark.parametrize("config", [GRPOConfig, GSPOConfig, GMPOConfig, SAPOConfig, CISPOConfig])
def test_every_policy_loss_has_the_settings_with_their_defaults(config):
    c = config()
    assert (c.kl_loss_bias_correction, c.log_ratio_clamp, c.kl_clamp) == (False, 20.0, 10.0)
    assert config(log_ratio_clamp=None, kl_clamp=None).kl_clamp is None
    with pytest.raises(pydantic.ValidationError, match="kl_clamp"):
        config(kl_clamp=0.0)
