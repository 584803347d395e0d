"""The teacher-distribution forms of `distill`: forward KL, reverse KL, GKD's JSD(beta) and the top-k
renormalisation, checked against values worked out by hand on 3- and 4-token vocabularies."""

import math

import pytest
import torch

from alignflow.core.rl.algorithm import PolicyBatch, Rollout
from alignflow.core.rl.divergence import divergence, logit_divergence, top_k_log_probs
from alignflow.plugins.distill import Distill, DistillConfig

ln = math.log
P = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)  # teacher
Q = torch.tensor([0.125, 0.125, 0.75], dtype=torch.float64)  # student


def div(kind, beta=0.5, p=P, q=Q):
    return logit_divergence(q.log()[None, None], p.log()[None, None], kind, beta).item()


def test_forward_kl_by_hand():
    # KL(P || Q) = 0.5 ln(0.5/0.125) + 0.25 ln(0.25/0.125) + 0.25 ln(0.25/0.75) = 1.25 ln 2 - 0.25 ln 3
    assert div("forward_kl") == pytest.approx(1.25 * ln(2) - 0.25 * ln(3), abs=1e-12)


def test_reverse_kl_by_hand():
    # KL(Q || P) = 0.125 ln(0.125/0.5) + 0.125 ln(0.125/0.25) + 0.75 ln(0.75/0.25) = -0.375 ln 2 + 0.75 ln 3
    assert div("reverse_kl") == pytest.approx(-0.375 * ln(2) + 0.75 * ln(3), abs=1e-12)


def test_jsd_half_by_hand():
    # M = 0.5 P + 0.5 Q = [0.3125, 0.1875, 0.5]
    kl_pm = 0.5 * ln(0.5 / 0.3125) + 0.25 * ln(0.25 / 0.1875) + 0.25 * ln(0.25 / 0.5)
    kl_qm = 0.125 * ln(0.125 / 0.3125) + 0.125 * ln(0.125 / 0.1875) + 0.75 * ln(0.75 / 0.5)
    assert div("jsd", 0.5) == pytest.approx(0.5 * kl_pm + 0.5 * kl_qm, abs=1e-12)


def test_jsd_weights_the_teacher_by_beta():
    # beta = 0.25: M = 0.25 P + 0.75 Q = [0.21875, 0.15625, 0.625]; beta KL(P||M) + (1 - beta) KL(Q||M)
    kl_pm = 0.5 * ln(0.5 / 0.21875) + 0.25 * ln(0.25 / 0.15625) + 0.25 * ln(0.25 / 0.625)
    kl_qm = 0.125 * ln(0.125 / 0.21875) + 0.125 * ln(0.125 / 0.15625) + 0.75 * ln(0.75 / 0.625)
    assert div("jsd", 0.25) == pytest.approx(0.25 * kl_pm + 0.75 * kl_qm, abs=1e-12)


def test_jsd_limits_are_the_two_kls():
    # JSD(beta) / beta -> KL(P || Q) as beta -> 0; JSD(beta) / (1 - beta) -> KL(Q || P) as beta -> 1
    eps = 1e-7
    assert div("jsd", eps) / eps == pytest.approx(div("forward_kl"), rel=1e-5)
    assert div("jsd", 1 - eps) / eps == pytest.approx(div("reverse_kl"), rel=1e-5)
    assert div("jsd", eps) < 1e-6 and div("jsd", 1 - eps) < 1e-6  # JSD itself vanishes at both ends
    with pytest.raises(ValueError, match="0 < beta < 1"):
        divergence(Q.log(), P.log(), "jsd", 0.0)


def test_every_divergence_is_zero_for_equal_distributions():
    for kind in ("forward_kl", "reverse_kl", "jsd"):
        assert div(kind, q=P) == pytest.approx(0.0, abs=1e-15)


def test_gradients_with_respect_to_the_student_logits():
    z = Q.log().clone().requires_grad_()
    logit_divergence(z[None, None], P.log()[None, None], "forward_kl").sum().backward()
    torch.testing.assert_close(z.grad, Q - P)  # d KL(P || softmax z) / dz = Q - P
    z.grad = None
    logit_divergence(z[None, None], P.log()[None, None], "reverse_kl").sum().backward()
    # d KL(Q || P) / dz_v = Q_v (log Q_v - log P_v - KL(Q || P))
    torch.testing.assert_close(z.grad, Q * (Q.log() - P.log() - div("reverse_kl")))


P4 = torch.tensor([0.4, 0.3, 0.2, 0.1], dtype=torch.float64)
Q4 = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)


def test_top_k_renormalises_both_over_the_teachers_top_tokens():
    s, t = top_k_log_probs(Q4.log(), P4.log(), 2)  # the teacher's top 2: tokens 0 and 1
    torch.testing.assert_close(t.exp(), torch.tensor([4 / 7, 3 / 7], dtype=torch.float64))
    torch.testing.assert_close(s.exp(), torch.tensor([1 / 3, 2 / 3], dtype=torch.float64))
    got = logit_divergence(Q4.log()[None, None], P4.log()[None, None], "forward_kl", top_k=2).item()
    assert got == pytest.approx(4 / 7 * ln((4 / 7) / (1 / 3)) + 3 / 7 * ln((3 / 7) / (2 / 3)), abs=1e-12)


def test_top_k_without_renormalising_is_verls_sum():
    # sum over the teacher's top 2 of P (log P - log Q), the tail mass ignored
    got = logit_divergence(Q4.log()[None, None], P4.log()[None, None], "forward_kl", top_k=2, tail="drop").item()
    assert got == pytest.approx(0.4 * ln(4) + 0.3 * ln(1.5), abs=1e-12)


def test_top_k_drop_is_zero_at_the_teacher_and_never_negative():
    """verl floors each position's partial sum at 0: a student with more mass than the teacher on the teacher's top
    tokens gets 0 and no gradient, where the unfloored sum was negative and pushed it further."""
    # the student is the teacher: exactly 0 (the floor's boundary passes the sum's gradient, as verl's clamp_min)
    assert logit_divergence(P4.log()[None, None], P4.log()[None, None], "forward_kl", top_k=2, tail="drop").item() == 0
    # students near the teacher: never below 0, and 0 exactly where the unfloored sum is negative
    torch.manual_seed(0)
    near = (P4.log() + 0.05 * torch.randn(64, 4, dtype=torch.float64))[:, None]
    got = logit_divergence(near, P4.log().expand(64, 1, 4), "forward_kl", top_k=2, tail="drop")[:, 0]
    q = near[:, 0].softmax(-1)
    unfloored = (P4[:2] * (P4[:2].log() - q[:, :2].log())).sum(-1)
    assert (unfloored < 0).sum() > 10 and (unfloored > 0).sum() > 10  # both sides drawn
    torch.testing.assert_close(got, unfloored.clamp(min=0.0))
    # Q = [0.45, 0.35, 0.1, 0.1] on the top 2 (P 0.4, 0.3): 0.4 ln(0.4/0.45) + 0.3 ln(0.3/0.35) = -0.093358,
    # now 0 with no gradient
    q = torch.tensor([0.45, 0.35, 0.1, 0.1], dtype=torch.float64)
    assert 0.4 * ln(0.4 / 0.45) + 0.3 * ln(0.3 / 0.35) == pytest.approx(-0.093358, abs=1e-6)
    z = q.log().clone().requires_grad_()
    got = logit_divergence(z[None, None], P4.log()[None, None], "forward_kl", top_k=2, tail="drop")
    got.sum().backward()
    assert got.item() == 0.0 and torch.equal(z.grad, torch.zeros(4, dtype=torch.float64))


def test_top_k_drop_floors_each_log_prob_at_minus_10():
    """P = [0.5, 0.3, 0.2], the student's Q = [e^-12, 0.5, 0.5 - e^-12], top 2: the first term takes log Q = -10
    (verl's `log_prob_min_clamp`), 0.5 (ln 0.5 + 10) + 0.3 ln(0.3/0.5) = 4.500178 (unfloored: 5.500178), and that
    token's log-prob gets no gradient: d/dz = 0.3 (Q - onehot(1)) from the second term alone."""
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    tiny = math.exp(-12)
    q = torch.tensor([tiny, 0.5, 0.5 - tiny], dtype=torch.float64)
    z = q.log().clone().requires_grad_()
    got = logit_divergence(z[None, None], p.log()[None, None], "forward_kl", top_k=2, tail="drop")
    expected = 0.5 * (ln(0.5) + 10) + 0.3 * ln(0.3 / 0.5)
    assert expected == pytest.approx(4.500178, abs=1e-6) and got.item() == pytest.approx(expected, abs=1e-12)
    got.sum().backward()
    torch.testing.assert_close(z.grad, 0.3 * (q - torch.tensor([0.0, 1.0, 0.0], dtype=torch.float64)))


def test_top_k_with_a_tail_bucket():
    # outcomes {0, 1, rest}: P = [0.4, 0.3, 0.3], Q = [0.1, 0.2, 0.7]
    s, t = top_k_log_probs(Q4.log(), P4.log(), 2, "bucket")
    torch.testing.assert_close(t.exp(), torch.tensor([0.4, 0.3, 0.3], dtype=torch.float64))
    torch.testing.assert_close(s.exp(), torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64))
    got = logit_divergence(Q4.log()[None, None], P4.log()[None, None], "reverse_kl", top_k=2, tail="bucket").item()
    assert got == pytest.approx(0.1 * ln(0.1 / 0.4) + 0.2 * ln(0.2 / 0.3) + 0.7 * ln(0.7 / 0.3), abs=1e-12)


def test_renormalised_top_k_leaves_the_students_tail_alone():
    z = Q4.log().clone().requires_grad_()
    logit_divergence(z[None, None], P4.log()[None, None], "forward_kl", top_k=2).sum().backward()
    assert torch.equal(z.grad[2:], torch.zeros(2, dtype=torch.float64))  # tokens 2 and 3: no gradient
    # inside the top 2: Q' - P' = [1/3 - 4/7, 2/3 - 3/7]
    torch.testing.assert_close(z.grad[:2], torch.tensor([1 / 3 - 4 / 7, 2 / 3 - 3 / 7], dtype=torch.float64))


def test_top_k_of_the_whole_vocabulary_is_the_full_form_and_chunks_change_nothing():
    torch.manual_seed(0)
    s, t = torch.randn(2, 7, 5, dtype=torch.float64), torch.randn(2, 7, 5, dtype=torch.float64)
    full = logit_divergence(s, t, "jsd", 0.3)
    torch.testing.assert_close(logit_divergence(s, t, "jsd", 0.3, top_k=5), full)
    torch.testing.assert_close(logit_divergence(s, t, "jsd", 0.3, chunk=2), full)


def batch(mask):
    b, t = mask.shape
    zeros = torch.zeros(b, t)
    return PolicyBatch(logprobs=zeros, old_logprobs=zeros, advantages=zeros, response_mask=mask,
                       group=torch.zeros(b, dtype=torch.long))


def test_the_full_form_loss_is_the_divergence_per_response_token_averaged_per_sequence():
    algo = Distill(DistillConfig(form="full", divergence="forward_kl"))
    assert algo.uses_teacher_logits and algo.loss_agg_mode == "seq-mean-token-mean"  # GKD's 1/L_y per sequence
    assert Distill().loss_agg_mode == "token-mean" and not Distill().uses_teacher_logits  # sampled: unchanged
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    student = Q.log().expand(2, 2, 3).float()
    teacher = P.log().expand(2, 2, 3).float()
    per_token, metrics = algo.distribution_loss(batch(mask), student, teacher)
    kl = 1.25 * ln(2) - 0.25 * ln(3)
    torch.testing.assert_close(per_token, torch.tensor([[kl, kl], [kl, 0.0]]))
    assert metrics["distill/full_forward_kl"].item() == pytest.approx(kl)


def test_the_full_form_has_no_kl_advantage_and_trains_every_row():
    algo = Distill(DistillConfig(form="top_k", top_k=2))
    mask = torch.ones(2, 3)
    r = Rollout(rewards=torch.tensor([1.0, 0.0]), group=torch.tensor([0, 0]), response_mask=mask,
                old_logprobs=torch.zeros(2, 3), teacher_logprobs=-torch.ones(2, 3), max_new_tokens=3)
    adv, _ = algo.advantages(r)
    assert torch.equal(adv, torch.zeros(2, 3)) and algo.inert_rows(r, adv) is None
    adv, _ = Distill(DistillConfig(form="full", reward_weight=2.0)).advantages(r)
    torch.testing.assert_close(adv, torch.tensor([[1.0] * 3, [-1.0] * 3]))  # 2 x (R - mean R)


def test_settings_are_checked():
    with pytest.raises(ValueError, match="beta"):
        DistillConfig(form="full", beta=1.0)
    with pytest.raises(ValueError, match="kl_discount applies to form 'sampled' only"):
        DistillConfig(form="full", kl_discount=0.9)
