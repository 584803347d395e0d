"""DAPO: accuracy-based group filter, clip-higher, token-mean loss, no KL."""

import pytest
import torch

from alignflow.core.rl.aggregation import aggregate
from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.dapo import DAPO


def rollout(correct, rewards=None, group=None):
    n = len(correct)
    correct = torch.tensor(correct, dtype=torch.float)
    return Rollout(
        rewards=correct if rewards is None else torch.tensor(rewards), correct=correct,
        group=torch.arange(n) // 4 if group is None else torch.tensor(group),
        response_mask=torch.ones(n, 3), old_logprobs=torch.zeros(n, 3), max_new_tokens=3,
    )


def test_defaults_follow_the_paper():
    algo = DAPO()
    c = algo.config
    assert (c.clip_low, c.clip_high, c.kl_loss_coef) == (0.2, 0.28, 0.0)
    assert algo.loss_agg_mode == "token-mean" and not algo.requires_reference and algo.max_gen_batches == 10


def test_filter_drops_all_correct_and_all_wrong_groups():
    r = rollout([1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 0, 1, 1], group=[0] * 4 + [1] * 4 + [2] * 4 + [3])
    assert DAPO().filter_groups(r).tolist() == [False] * 8 + [True] * 4 + [True]  # a lone response is kept


def test_filter_reads_accuracy_not_the_shaped_reward():
    # All wrong, but an overlong penalty makes the rewards differ: still dropped.
    r = rollout([0, 0, 0, 0], rewards=[-0.5, 0.0, 0.0, 0.0])
    assert not DAPO().filter_groups(r).any()
    with pytest.raises(DataError, match="accuracy"):
        DAPO().filter_groups(Rollout(rewards=torch.zeros(2), group=torch.zeros(2, dtype=torch.long),
                                     response_mask=torch.ones(2, 1), old_logprobs=torch.zeros(2, 1), max_new_tokens=1))


def test_clip_higher_token_mean_loss():
    algo = DAPO()
    r = rollout([1, 0, 0, 1])
    adv, _ = algo.advantages(r)
    a = adv[0, 0].item()  # 0.5 / sqrt(1/3)
    # ratios per row: 1.25 (A > 0, inside 1.28), 1.0, 1.0, 1.4 (A > 0, clipped to 1.28)
    ratios = torch.tensor([1.25, 1.0, 1.0, 1.4])[:, None].expand(4, 3)
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    r.response_mask = mask
    per_token, m = algo.loss(r.minibatch(torch.arange(4), logprobs=ratios.log(), advantages=adv * mask))
    loss = aggregate(per_token, mask, algo.loss_agg_mode)
    expected = (-a * 1.25 * 3 + a * 3 + a * 1 - a * 1.28 * 2) / 9  # sum over the 9 tokens / 9
    assert loss.item() == pytest.approx(expected, rel=1e-5)
    assert m["actor/clip_high_frac"].item() == pytest.approx(2 / 9)
