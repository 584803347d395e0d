import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.train.offline import PairBatch, TokenLogps
from alignflow.plugins.bnf import BNF

H = [0.5, 0.25, 0.25]  # a next-token distribution over a vocabulary of 3
U = [1 / 3, 1 / 3, 1 / 3]
PAD = [0.1, 0.1, 0.8]  # behind the mask: must not count


def policy(probs, targets, mask, requires_grad=False):
    """(TokenLogps of a policy with next-token distributions `probs` [N, T, V], its logits leaf)."""
    logits = torch.tensor(probs, dtype=torch.float64).log().requires_grad_(requires_grad)
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, torch.tensor(targets)[..., None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1).detach()
    mask = torch.tensor(mask, dtype=torch.bool)
    return TokenLogps(torch.where(mask, logps, 0.0), mask, torch.where(mask, entropy, 0.0)), logits


def reference(p_targets, mask):
    """TokenLogps of the reference from its probabilities of the target tokens [N, T]."""
    mask = torch.tensor(mask, dtype=torch.bool)
    return TokenLogps(torch.where(mask, torch.tensor(p_targets, dtype=torch.float64).log(), 0.0), mask)


def pair_batch(chosen, rejected, ref_chosen, ref_rejected) -> PairBatch:
    return PairBatch(
        chosen.logps.sum(-1), rejected.logps.sum(-1), chosen.mask.sum(-1), rejected.mask.sum(-1),
        ref_chosen.logps.sum(-1), ref_rejected.logps.sum(-1),
        chosen_tokens=chosen, rejected_tokens=rejected, ref_chosen_tokens=ref_chosen, ref_rejected_tokens=ref_rejected,
    )


def hand_pair(requires_grad=False):
    """One pair: y_w = 2 tokens (and a padded position), y_l = 3 tokens, vocabulary 3."""
    chosen, zc = policy([[H, H, PAD]], [[0, 1, 2]], [[1, 1, 0]], requires_grad)
    rejected, zr = policy([[U, U, H]], [[0, 1, 0]], [[1, 1, 1]], requires_grad)
    ref_c = reference([[0.25, 0.5, 0.9]], [[1, 1, 0]])
    ref_r = reference([[2 / 3, 1 / 3, 0.5]], [[1, 1, 1]])
    return pair_batch(chosen, rejected, ref_c, ref_r), zc, zr


def test_flags_and_no_hyperparameters():
    assert BNF.stage == "preference" and BNF.requires_reference and BNF.requires_pairs
    assert BNF.needs_token_logprobs and not BNF.requires_labels and BNF().nll_scope is None
    assert BNF.Config.model_fields == {}  # nothing to tune but the optimizer
    with pytest.raises(ValidationError):
        BNF.Config(beta=0.1)


def test_loss_on_a_hand_built_pair():
    loss, metrics = BNF().loss(hand_pair()[0])
    ln2, ln4, ln3 = math.log(2), math.log(4), math.log(3)  # 0.693147, 1.386294, 1.098612
    # y_w t1: p = 0.5, p_ref = 0.25 -> w = min(0.5 / 0.25, 1) = 1, u = 1e-6 / 0.5 ~ 0: l = log 0.5 = -0.693147
    l_w1 = -ln2
    # y_w t2: p = 0.25, p_ref = 0.5 -> w = 0.5, u = 0.5 / 0.75 = 2/3,
    # E = 0.5 log 0.5 + 0.25 log 0.25 = -0.693147: l = 0.5 * -1.386294 + 2/3 * -0.693147 = -1.155245
    l_w2 = 0.5 * -ln4 + (2 / 3) * (0.5 * -ln2 + 0.25 * -ln4)
    # y_l t1: uniform p = 1/3, p_ref = 2/3 -> w = 0.5, Q = (0.5, 0.25, 0.25): l = log(1/3) = -1.098612
    # y_l t2: p = p_ref = 1/3 -> w = 1, l = -1.098612;  y_l t3: p = p_ref = 0.5 -> w = 1, l = -0.693147
    l_l = -ln3 - ln3 - ln2  # -2.890372
    t_min = 2  # min(|y_w| = 2, |y_l| = 3)
    expected = -((l_w1 + l_w2) / t_min - l_l / t_min)  # -(-0.924196 + 1.445186) = -0.520990
    assert expected == pytest.approx(-0.520990, abs=1e-6)
    assert loss.item() == pytest.approx(expected, abs=1e-5)  # the 1e-6 terms move it by < 1e-5
    # rewards are the summed log-ratios (DPO's implicit reward with beta = 1), as oat logs them
    assert metrics["rewards/chosen"].item() == pytest.approx(-ln2 + ln4 - ln4 + ln2, abs=1e-12)  # 0
    assert metrics["rewards/rejected"].item() == pytest.approx(-ln3 + math.log(1.5), abs=1e-12)  # -0.693147


def test_t_min_is_the_shortest_completion_in_the_micro_batch():
    """With a second pair of one-token completions, T_min = 1 for the first pair too (batch-dependent)."""
    chosen, _ = policy([[H, H, PAD], [H, PAD, PAD]], [[0, 1, 2], [0, 2, 2]], [[1, 1, 0], [1, 0, 0]])
    rejected, _ = policy([[U, U, H], [H, PAD, PAD]], [[0, 1, 0], [0, 2, 2]], [[1, 1, 1], [1, 0, 0]])
    ref_c = reference([[0.25, 0.5, 0.9], [0.25, 0.9, 0.9]], [[1, 1, 0], [1, 0, 0]])
    ref_r = reference([[2 / 3, 1 / 3, 0.5], [0.5, 0.9, 0.9]], [[1, 1, 1], [1, 0, 0]])
    losses, _, _ = BNF().pair_losses(pair_batch(chosen, rejected, ref_c, ref_r))
    # pair 1: -(-1.848392 - -2.890372) / 1; pair 2: y_w t1 = y_l t1 in value (l = log 0.5): -(l - l) / 1 = 0
    assert losses.tolist() == pytest.approx([-1.041980, 0.0], abs=1e-5)


def random_pair(seed, vocab=5):
    """(a pair of random policies and references, the chosen and rejected logits, their target tokens)."""
    g = torch.Generator().manual_seed(seed)
    probs = lambda: torch.softmax(2 * torch.randn(2, 4, vocab, generator=g, dtype=torch.float64), -1)
    mask_c, mask_r = [[1, 1, 1, 0], [1, 1, 1, 1]], [[1, 1, 0, 0], [1, 1, 1, 1]]
    y_c, y_r = torch.randint(vocab, (2, 4), generator=g), torch.randint(vocab, (2, 4), generator=g)
    chosen, zc = policy(probs().tolist(), y_c.tolist(), mask_c, requires_grad=True)
    rejected, zr = policy(probs().tolist(), y_r.tolist(), mask_r, requires_grad=True)
    ref_c, ref_r = (probs().gather(-1, y[..., None]).squeeze(-1).tolist() for y in (y_c, y_r))
    batch = pair_batch(chosen, rejected, reference(ref_c, mask_c), reference(ref_r, mask_r))
    return batch, (zc, zr), (y_c, y_r)


def dynamic_target_gradient(tokens: TokenLogps, ref: TokenLogps, logits, targets) -> torch.Tensor:
    """d l_t / d logits = Q_t - p for l_t = sum_v Q_t(v) log p_v with Q_t held fixed:
    Q_t(y_t) = w_t, Q_t(v) = (1 - w_t) p_v / (1 - p_t) for v != y_t (the 1e-6 terms left out)."""
    p_all = logits.detach().softmax(-1)
    p = tokens.logps.detach().exp()
    w = torch.clamp(p / ref.logps.exp(), max=1.0)
    is_target = torch.nn.functional.one_hot(targets, p_all.shape[-1]).bool()
    q = torch.where(is_target, w[..., None], ((1 - w) / (1 - p))[..., None] * p_all)
    return torch.where(tokens.mask[..., None], q - p_all, 0.0)


def test_gradient_is_cross_entropy_against_the_dynamic_target():
    for seed in range(3):
        batch, (zc, zr), (y_c, y_r) = random_pair(seed)
        w = torch.clamp(batch.chosen_tokens.logps.exp() / batch.ref_chosen_tokens.logps.exp(), max=1)
        assert (w[batch.chosen_tokens.mask] < 1).any() and (w[batch.chosen_tokens.mask] == 1).any(), seed
        BNF().loss(batch)[0].backward()
        # loss = -(1/B) sum_i (S(y_w) - S(y_l)), S = sum_t l_t / T_min; B = 2 pairs, T_min = 2 (rejected row 0)
        scale = 2 * 2
        expected_c = -dynamic_target_gradient(batch.chosen_tokens, batch.ref_chosen_tokens, zc, y_c) / scale
        expected_r = dynamic_target_gradient(batch.rejected_tokens, batch.ref_rejected_tokens, zr, y_r) / scale
        assert torch.allclose(zc.grad, expected_c, atol=1e-5) and torch.allclose(zr.grad, expected_r, atol=1e-5)
        assert zc.grad.abs().max() > 1e-2  # not vacuous


def full_vocabulary_s(tokens: TokenLogps, ref: TokenLogps, logits, targets, detach=True) -> torch.Tensor:
    """S(y) * T_min as oat writes it: E_t = sum_v sg(p_v) log p_v - sg(p_t) log p_t over the log-softmax."""
    sg = (lambda t: t.detach()) if detach else (lambda t: t)
    logp_all = logits.log_softmax(-1)
    logp = logp_all.gather(-1, targets[..., None]).squeeze(-1)
    e = (logp_all.exp().detach() * logp_all).sum(-1) - logp.exp().detach() * logp
    w = sg(torch.clamp(logp.exp() / (ref.logps.exp() + 1e-6), max=1.0))
    u = sg((1 - w + 1e-6) / (1 - logp.exp() + 1e-6))
    return ((w * logp + u * e) * tokens.mask).sum(-1)


def test_the_entropy_form_equals_the_full_vocabulary_form_in_value_and_gradient():
    """Our E_t = -sg(H_t) - sg(p_t) log p_t: the same value and gradient as oat's [N, T, V] form."""
    batch, (zc, zr), (y_c, y_r) = random_pair(7)
    loss = BNF().loss(batch)[0]
    ours = torch.autograd.grad(loss, (zc, zr))
    s_w = full_vocabulary_s(batch.chosen_tokens, batch.ref_chosen_tokens, zc, y_c) / 2  # T_min = 2
    s_l = full_vocabulary_s(batch.rejected_tokens, batch.ref_rejected_tokens, zr, y_r) / 2
    oat = -(s_w - s_l).mean()
    theirs = torch.autograd.grad(oat, (zc, zr))
    assert loss.item() == pytest.approx(oat.item(), abs=1e-12)
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(ours, theirs))


def test_weights_are_detached():
    """Differentiating w_t and u_t too would add their gradients where w_t < 1: a different update."""
    batch, (zc, _), (y_c, _) = random_pair(3)
    (grad,) = torch.autograd.grad(BNF().loss(batch)[0], zc)
    attached = -full_vocabulary_s(batch.chosen_tokens, batch.ref_chosen_tokens, zc, y_c, detach=False).sum() / 4
    (wrong,) = torch.autograd.grad(attached, zc)
    assert not torch.allclose(grad, wrong, atol=1e-4)
