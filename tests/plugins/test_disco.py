"""DisCO: the DRO objective over positives/negatives of each group and the squared-hinge KL penalty."""

import math

import pytest
import torch

from alignflow.core.rl.aggregation import StepNorm, aggregate
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.disco import DisCO, DisCOConfig

# Group 0 is mixed (correct 1, 0, 0, 1); group 1 is all correct: no term, but it counts in n_Q.
TOKENS = [[-0.5, -1.0], [-2.0], [-0.3, -0.6, -0.9], [-1.0, -0.2], [-1.0], [-1.0], [-1.0], [-1.0]]
MASK = torch.tensor([[1] * len(t) + [0] * (3 - len(t)) for t in TOKENS])
LOGPROBS = torch.tensor([t + [0.0] * (3 - len(t)) for t in TOKENS])
CORRECT = torch.tensor([1.0, 0, 0, 1, 1, 1, 1, 1])


def rollout(correct=CORRECT):
    return Rollout(rewards=correct, correct=correct, group=torch.arange(8) // 4, response_mask=MASK,
                   old_logprobs=LOGPROBS, max_new_tokens=3)


def step_loss(algo, r, parts):
    """Sum of micro-batch losses of one optimizer step; returns it and the log-prob leaf."""
    logprobs = LOGPROBS.clone().requires_grad_()
    norm = StepNorm.of([MASK[p] for p in parts])
    total = 0.0
    for p in parts:
        per_token, _ = algo.loss(r.minibatch(p, logprobs=logprobs[p], advantages=torch.zeros(8, 3)))
        total = total + aggregate(per_token, MASK[p], algo.loss_agg_mode, norm)
    return total, logprobs


def test_defaults_and_binary_check():
    algo = DisCO()
    assert (algo.config.score, algo.tau, algo.config.delta, algo.config.beta) == ("logL", 10.0, 1e-4, 1e3)
    assert DisCO(DisCOConfig(score="Lratio")).tau == 1.0
    assert not algo.requires_reference and not algo.requires_critic and algo.requires_whole_groups
    adv, returns = algo.advantages(rollout())
    assert not adv.any() and returns is None
    with pytest.raises(DataError, match="binary"):
        algo.advantages(rollout(CORRECT * 0.5))


@pytest.mark.parametrize("parts", [[torch.arange(8)], [torch.arange(4), torch.arange(4, 8)]])
def test_logL_objective_value_and_gradient(parts):
    loss, logprobs = step_loss(DisCO(), rollout(), parts)
    s = [-0.75, -2.0, -0.6, -0.6]  # token-mean log-likelihoods of group 0
    tau = 10.0
    neg = [math.exp(s[1] / tau), math.exp(s[2] / tau)]
    v0 = -(s[0] + s[3]) / 2 + tau * math.log(sum(neg) / 2)
    assert loss.item() == pytest.approx(v0 / 2, rel=1e-6)  # n_Q = 2
    loss.backward()
    # d/dlogp_{i,t} = (1/n_Q) * (-1/|P| for positives, softmax_j(s/tau) for negatives) / |o_i|
    w = [x / sum(neg) for x in neg]
    coef = [-0.5 / 2, w[0] / 1, w[1] / 3, -0.5 / 2, 0, 0, 0, 0]
    torch.testing.assert_close(logprobs.grad, torch.tensor(coef)[:, None] / 2 * MASK)


def test_Lratio_objective():
    ratios = torch.tensor([[1.2], [0.8], [1.1]])
    labels = torch.tensor([1.0, 0, 0])
    r = Rollout(rewards=labels, correct=labels, group=torch.zeros(3, dtype=torch.long),
                response_mask=torch.ones(3, 1), old_logprobs=torch.zeros(3, 1), max_new_tokens=1)
    algo = DisCO(DisCOConfig(score="Lratio"))
    per_token, m = algo.loss(r.minibatch(torch.arange(3), logprobs=ratios.log(), advantages=torch.zeros(3, 1)))
    # KL_hat = mean(-log r) < 0 < delta: no penalty; tau = 1
    expected = -1.2 + math.log((math.exp(0.8) + math.exp(1.1)) / 2)
    assert aggregate(per_token, r.response_mask, algo.loss_agg_mode).item() == pytest.approx(expected, rel=1e-6)
    assert m["disco/penalty"].item() == 0.0 and m["disco/objective"].item() == pytest.approx(-expected, rel=1e-6)


def test_squared_hinge_kl_penalty():
    # One all-correct group: only the penalty remains. k1 = log pi_old - log pi = [0.1, 0.2, 0.3], KL_hat = 0.2
    r = Rollout(rewards=torch.ones(2), correct=torch.ones(2), group=torch.zeros(2, dtype=torch.long),
                response_mask=torch.tensor([[1, 1], [1, 0]]), old_logprobs=torch.zeros(2, 2), max_new_tokens=2)
    algo = DisCO(DisCOConfig(beta=10.0, delta=0.05))
    logprobs = torch.tensor([[-0.1, -0.2], [-0.3, 0.0]], requires_grad=True)
    per_token, _ = algo.loss(r.minibatch(torch.arange(2), logprobs=logprobs, advantages=torch.zeros(2, 2)))
    loss = aggregate(per_token, r.response_mask, algo.loss_agg_mode)
    assert loss.item() == pytest.approx(10 / 2 * 0.15**2)  # (beta/2)[KL - delta]_+^2
    loss.backward()
    # beta [KL - delta]_+ * dKL/dlogp, dKL/dlogp = -1/3 per valid token
    torch.testing.assert_close(logprobs.grad, -10 * 0.15 / 3 * r.response_mask.float())
