"""ExPO: GRPO on the sampled rows, beta * NLL (no ratio, no KL, no advantage) on the guided self-explanations."""

import math

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.rl.algorithm import RLAlgorithm, Rollout
from alignflow.plugins.expo import ExPO, ExPOConfig
from alignflow.plugins.grpo import GRPO

# Rows: 0, 1 sampled, group 0, both wrong; 2 a guided self-explanation of group 0; 3, 4 sampled, group 1.
LENGTHS = [2, 3, 2, 1, 2]
MASK = torch.tensor([[1.0] * n + [0.0] * (3 - n) for n in LENGTHS])
GROUP = torch.tensor([0, 0, 0, 1, 1])
REWARDS = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0])
GUIDED = torch.tensor([False, False, True, False, False])
LOGPROBS = torch.tensor([[-1.0] * 3] * 2 + [[-0.5, -1.5, 0.0]] + [[-1.0] * 3] * 2) * MASK
OLD = LOGPROBS.clone()
OLD[2] = torch.tensor([-5.0, -5.0, 0.0])  # the sampler's, after the hinted prompt: no term may read it
REF = LOGPROBS - 0.5 * MASK  # log rho = -0.5 on every token, guided ones included
A = 0.5 / (math.sqrt(0.5) + 1e-6)  # group 1: rewards (1, 0), mean 0.5, unbiased std sqrt(0.5)
K3 = math.exp(-0.5) - 1 + 0.5  # rho - 1 - log rho at log rho = -0.5


def rollout(guided=GUIDED):
    return Rollout(rewards=REWARDS, group=GROUP, response_mask=MASK, old_logprobs=OLD, ref_logprobs=REF,
                   max_new_tokens=3, correct=REWARDS, guided=guided)


def step(algo, r, advantages=None):
    """The whole-step loss (seq-mean-token-mean over the 5 rows), d loss / d logprobs, and the metrics."""
    if advantages is None:
        advantages, _ = algo.advantages(r)
    logprobs = LOGPROBS.clone().requires_grad_()
    per_token, metrics = algo.loss(r.minibatch(torch.arange(5), logprobs=logprobs, advantages=advantages))
    loss = aggregate(per_token, MASK, algo.loss_agg_mode)
    loss.backward()
    return loss.item(), logprobs.grad, metrics


def test_defaults_follow_the_paper_and_grpo():
    algo = ExPO()
    c = algo.config
    assert (c.sft_coef, c.guided_samples) == (0.04, 4)  # beta = 0.04: the best of the paper's ablation
    assert (c.clip_low, c.clip_high, c.kl_loss_coef, algo.loss_agg_mode) == (0.2, 0.2, 0.04, "seq-mean-token-mean")
    assert algo.requires_reference and algo.guided_samples == 4
    assert algo.guided_prompt("37+48=", "85") == "<answer>85</answer>37+48="
    assert ExPO(ExPOConfig(hint_template="{prompt} is {answer}")).guided_prompt("1+1=", "2") == "1+1= is 2"
    # every other algorithm asks for no guided samples
    assert GRPO().guided_prompt("37+48=", "85") is None and GRPO().guided_samples == 0
    assert RLAlgorithm.guided_prompt is GRPO.guided_prompt


@pytest.mark.parametrize("template, error", [("{prompt}", "must show the answer"), ("{prompt}{hint}", "fields"),
                                             ("{answer} {", "fields")])
def test_a_hint_must_show_the_answer_and_name_known_fields(template, error):
    with pytest.raises(ValidationError, match=error):
        ExPOConfig(hint_template=template)


def test_guided_rows_get_no_advantage_and_stay_out_of_their_groups_baseline():
    adv, returns = ExPO().advantages(rollout())
    assert returns is None
    # group 0's sampled rows are all wrong: 0, not (0 - 1/3) / std as they would be with the guided row's 1 in it
    torch.testing.assert_close(adv, torch.tensor([0.0, 0.0, 0.0, A, -A])[:, None] * MASK)


def test_loss_is_grpo_on_sampled_rows_and_beta_nll_on_guided_rows():
    loss, grad, metrics = step(ExPO(), rollout())
    # per-row token means, then the mean over 5 rows (seq-mean-token-mean):
    #   rows 0, 1: -0 * 1 + 0.04 * k3; row 3: -A + 0.04 * k3; row 4: +A + 0.04 * k3
    #   row 2 (guided): 0.04 * mean NLL = 0.04 * (0.5 + 1.5) / 2 = 0.04; no KL on it
    assert loss == pytest.approx((4 * 0.04 * K3 + 0.04 * 1.0) / 5, abs=1e-7)  # = 0.011409
    # d/dlogp on a sampled token: (1/5)(1/|o_i|)(-A_i + 0.04 (1 - rho)), rho = e^-0.5, the ratio being 1
    kl_grad = 0.04 * (1 - math.exp(-0.5))
    expected = torch.tensor([kl_grad / (5 * 2), kl_grad / (5 * 3), 0.0, (-A + kl_grad) / 5, (A + kl_grad) / (5 * 2)])
    expected = expected[:, None] * MASK
    expected[2] = torch.tensor([-0.04 / (5 * 2)] * 2 + [0.0])  # the guided row: -beta / 5 / |c~| per token
    torch.testing.assert_close(grad, expected)
    # the ratio and KL metrics are of the sampled rows: a guided row's ratio to its hinted log-probs is e^4.5
    assert metrics["actor/ratio_mean"].item() == pytest.approx(1.0)
    assert metrics["actor/kl_ref"].item() == pytest.approx(K3)
    assert metrics["expo/sft_nll"].item() == pytest.approx(1.0)


def test_a_guided_row_ignores_its_advantage_and_old_logprobs():
    algo = ExPO()
    adv, _ = algo.advantages(rollout())
    pushed = adv.clone()
    pushed[2] = 5.0 * MASK[2]  # were the surrogate applied to it, this would change loss and gradient
    base = step(algo, rollout())
    again = step(algo, rollout(), advantages=pushed)
    assert again[0] == pytest.approx(base[0]) and torch.equal(again[1], base[1])


def test_without_guided_rows_it_is_grpo():
    plain = torch.tensor([True, True, False, True, True])
    r = rollout(guided=None).select(plain)
    r.old_logprobs = LOGPROBS[plain]
    for algo in (ExPO(), GRPO()):
        torch.testing.assert_close(algo.advantages(r)[0], GRPO().advantages(r)[0])
    adv, _ = GRPO().advantages(r)
    logprobs = LOGPROBS[plain].clone().requires_grad_()
    ours = ExPO().loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))[0]
    theirs = GRPO().loss(r.minibatch(torch.arange(4), logprobs=logprobs, advantages=adv))[0]
    torch.testing.assert_close(ours, theirs)
    # a rollout whose guided flags are all False is the same as one without them
    flagged = rollout(guided=torch.zeros(5, dtype=torch.bool))
    torch.testing.assert_close(ExPO().advantages(flagged)[0], GRPO().advantages(flagged)[0])


def test_a_micro_batch_of_guided_rows_only_reports_no_ratio_metrics():
    # The stage averages each metric over the micro-batches that report it: a 0 ratio from a micro-batch
    # without ordinary rows read 0.8 for a step whose ratios were all 1 (the r1-tiny run).
    r = rollout().select(GUIDED)
    logprobs = LOGPROBS[GUIDED].clone().requires_grad_()
    _, metrics = ExPO().loss(r.minibatch(torch.arange(1), logprobs=logprobs, advantages=torch.zeros(1, 3)))
    assert set(metrics) == {"expo/sft_nll"}
    assert metrics["expo/sft_nll"].item() == pytest.approx((0.5 + 1.5) / 2)  # row 2's two tokens
