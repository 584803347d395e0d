import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.train.offline import ListBatch, PairBatch
from alignflow.plugins.dpo import DPO
from alignflow.plugins.larpo import LarPO, list_losses, ranks

from tests.plugins.test_dpo import pairs  # the same two worked pairs


def log_sigmoid(x):
    return -math.log(1 + math.exp(-x))


LISTS = torch.tensor([[1.0, 0.5, -0.5], [-0.5, 1.0, 0.0]], dtype=torch.float64)  # best first


def test_flags_and_defaults():
    assert LarPO.stage == "preference" and LarPO.requires_reference and LarPO.requires_pairs
    c = LarPO.Config()
    assert (c.loss, c.beta, c.length_normalize) == ("contrastive", 0.1, False)


def test_contrastive_is_a_softmax_over_the_list_with_the_first_as_positive():
    got = list_losses(LISTS, "contrastive")
    a = -math.log(math.exp(1.0) / (math.exp(1.0) + math.exp(0.5) + math.exp(-0.5)))
    b = -math.log(math.exp(-0.5) / (math.exp(-0.5) + math.exp(1.0) + math.exp(0.0)))
    assert got.tolist() == pytest.approx([a, b], rel=1e-12)


def test_listmle_is_the_plackett_luce_likelihood_of_the_order():
    got = list_losses(LISTS, "listmle")
    e = math.exp
    a = -math.log(e(1.0) / (e(1.0) + e(0.5) + e(-0.5))) - math.log(e(0.5) / (e(0.5) + e(-0.5))) - 0.0
    b = -math.log(e(-0.5) / (e(-0.5) + e(1.0) + e(0.0))) - math.log(e(1.0) / (e(1.0) + e(0.0))) - 0.0
    assert got.tolist() == pytest.approx([a, b], rel=1e-12)


def test_lambdarank_weights_pairs_by_gain_and_rank_discount():
    # rank labels psi = (2, 1, 0): gains G = 2^psi - 1 = (3, 1, 0)
    assert ranks(LISTS).tolist() == [[1.0, 2.0, 3.0], [3.0, 1.0, 2.0]]  # positions under s
    got = list_losses(LISTS, "lambdarank")
    inv = lambda tau: 1 / math.log2(1 + tau)
    s, tau = [1.0, 0.5, -0.5], [1, 2, 3]
    g = [3, 1, 0]

    def term(i, j):
        return -abs(g[i] - g[j]) * abs(inv(tau[i]) - inv(tau[j])) * log_sigmoid(s[i] - s[j])

    a = term(0, 1) + term(0, 2) + term(1, 2)
    s, tau = [-0.5, 1.0, 0.0], [3, 1, 2]
    b = term(0, 1) + term(0, 2) + term(1, 2)
    assert got.tolist() == pytest.approx([a, b], rel=1e-12)


def test_lambdarank_with_scores_skips_ties():
    psi = torch.tensor([[0.8, 0.3, 0.3]], dtype=torch.float64)
    got = list_losses(LISTS[:1], "lambdarank", psi)
    g = [2 ** 0.8 - 1, 2 ** 0.3 - 1, 2 ** 0.3 - 1]
    inv = [1.0, 1 / math.log2(3), 0.5]
    s = [1.0, 0.5, -0.5]
    want = sum(-abs(g[0] - g[j]) * abs(inv[0] - inv[j]) * log_sigmoid(s[0] - s[j]) for j in (1, 2))
    assert got.item() == pytest.approx(want, rel=1e-12)


@pytest.mark.parametrize("form", ["contrastive", "listmle"])
@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_two_candidates_are_dpo(form, beta):
    larpo, _ = LarPO(LarPO.Config(loss=form, beta=beta)).loss(pairs())
    dpo, _ = DPO(DPO.Config(beta=beta)).loss(pairs())
    assert larpo.item() == pytest.approx(dpo.item(), rel=1e-12)
    a, b = pairs(requires_grad=True), pairs(requires_grad=True)
    LarPO(LarPO.Config(loss=form, beta=beta)).loss(a)[0].backward()
    DPO(DPO.Config(beta=beta)).loss(b)[0].backward()
    assert torch.allclose(a.policy_chosen_logps.grad, b.policy_chosen_logps.grad, rtol=1e-12)
    assert torch.allclose(a.policy_rejected_logps.grad, b.policy_rejected_logps.grad, rtol=1e-12)


def test_two_candidates_lambdarank_is_dpo_times_its_one_weight():
    larpo, metrics = LarPO(LarPO.Config(loss="lambdarank")).loss(pairs())
    dpo, dpo_metrics = DPO().loss(pairs())
    # G = (1, 0), ranks (1, 2) whichever way s orders the pair: lambda = 1 - 1/log2(3)
    assert larpo.item() == pytest.approx((1 - 1 / math.log2(3)) * dpo.item(), rel=1e-12)
    assert metrics["rewards/margins"].item() == pytest.approx(dpo_metrics["rewards/margins"].item(), rel=1e-12)


def test_length_normalize_averages_the_log_ratio_over_completion_tokens():
    loss, metrics = LarPO(LarPO.Config(beta=2.0, length_normalize=True)).loss(pairs())
    chosen = [2.0 * (-1.0 - -2.0) / 2, 2.0 * (-4.0 - -3.5) / 4]
    rejected = [2.0 * (-3.0 - -2.5) / 5, 2.0 * (-2.0 - -2.5) / 2]
    want = sum(-log_sigmoid(c - r) for c, r in zip(chosen, rejected)) / 2
    assert loss.item() == pytest.approx(want, rel=1e-12)
    assert metrics["rewards/chosen"].item() == pytest.approx(sum(chosen) / 2, rel=1e-12)


def test_config_is_validated():
    with pytest.raises(ValidationError):
        LarPO.Config(loss="lipo")
    with pytest.raises(ValidationError):
        LarPO.Config(beta=0.0)
    with pytest.raises(ValueError, match="unknown LarPO loss"):
        list_losses(LISTS, "lipo")


def test_a_ranked_list_scores_each_completion_by_its_implicit_reward():
    # s = beta * (log pi - log pi_ref) = 0.1 * ((-4) - (-5), (-6) - (-5), (-9) - (-7)) = (0.1, -0.1, -0.2)
    batch = ListBatch(torch.tensor([[-4.0, -6.0, -9.0]], dtype=torch.float64), torch.tensor([[3, 4, 5]]),
                      torch.tensor([[-5.0, -5.0, -7.0]], dtype=torch.float64),
                      torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64))
    e = math.exp
    losses, rewards = LarPO().ranked_losses(batch)
    assert rewards.tolist()[0] == pytest.approx([0.1, -0.1, -0.2], rel=1e-12)
    assert losses.item() == pytest.approx(-math.log(e(0.1) / (e(0.1) + e(-0.1) + e(-0.2))), rel=1e-12)
    # lambdarank with the rows' scores psi = (1, 0, 0): only the pairs (1, 2) and (1, 3) count, G = (1, 0, 0),
    # tau = (1, 2, 3) under s, so lambda_12 = 1 - 1/log2(3) and lambda_13 = 1 - 1/2
    losses, _ = LarPO(LarPO.Config(loss="lambdarank")).ranked_losses(batch)
    want = -(1 - 1 / math.log2(3)) * log_sigmoid(0.2) - 0.5 * log_sigmoid(0.3)
    assert losses.item() == pytest.approx(want, rel=1e-12)
