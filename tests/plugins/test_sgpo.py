"""SGPO: in all-negative groups, reward + scale * (steps before the first step scored < 0.5) / steps; then GRPO."""

import math

import pytest
import torch

from alignflow.core.errors import DataError
from alignflow.core.rl.algorithm import Rollout
from alignflow.plugins.grpo import GRPO
from alignflow.plugins.sgpo import SGPO, SGPOConfig, correct_prefix

EPS = 1e-6
WIDTH = 7  # position 0 is a prompt token; the response is positions 1..6


def rollout(rewards, steps, group=None, correct=None):
    """`steps[i]`: the judge's score of each step of response i, in order; step j ends at position j + 1."""
    n = len(rewards)
    step_rewards, step_mask = torch.zeros(n, WIDTH), torch.zeros(n, WIDTH)
    for row, scores in enumerate(steps):
        for j, s in enumerate(scores):
            step_rewards[row, j + 1], step_mask[row, j + 1] = s, 1.0
    mask = torch.ones(n, WIDTH)
    mask[:, 0] = 0
    rewards = torch.tensor(rewards, dtype=torch.float)
    return Rollout(rewards=rewards, group=torch.zeros(n, dtype=torch.long) if group is None else torch.tensor(group),
                   response_mask=mask, old_logprobs=torch.zeros(n, WIDTH), max_new_tokens=WIDTH - 1,
                   correct=(rewards > 0).float() if correct is None else torch.tensor(correct, dtype=torch.float),
                   step_rewards=step_rewards, step_mask=step_mask)


# One all-negative group of 4; the first step below 0.5 is the first error (0.5 itself passes).
NEGATIVE_STEPS = [
    [0.9, 0.8, 0.3],  # first error at step 3: 2 of 3 correct -> 2/3
    [0.2, 0.9],  # first error at step 1: 0 of 2 -> 0 (the later 0.9 does not count)
    [0.7, 0.5, 0.55, 0.9],  # no step below 0.5: 4 of 4 -> 1
    [0.6, 0.4, 0.9, 0.1],  # first error at step 2: 1 of 4 -> 1/4
]


def test_flags_and_defaults():
    algo = SGPO()
    c = algo.config
    assert algo.requires_step_rewards and algo.stage == "rl" and algo.requires_reference  # GRPO's k3 KL
    assert (c.step_threshold, c.scale, c.kl_loss_coef, c.clip_low, c.clip_high) == (0.5, 0.5, 0.04, 0.2, 0.2)
    assert algo.loss_agg_mode == "seq-mean-token-mean"
    with pytest.raises(ValueError):
        SGPOConfig(scale=1.0)  # a wrong answer must stay below a correct one


def test_correct_prefix_fraction():
    r = rollout([0.0] * 4, NEGATIVE_STEPS)
    torch.testing.assert_close(correct_prefix(r.step_rewards, r.step_mask, 0.5),
                               torch.tensor([2 / 3, 0.0, 1.0, 1 / 4]))


def test_all_negative_group_by_hand():
    # graded rewards, scale 0.5: [1/3, 0, 1/2, 1/8] = [32, 0, 48, 12] / 96; mean = 92/96/4 = 23/96
    # deviations [9, -23, 25, -11] / 96; squares (81 + 529 + 625 + 121) / 96^2 = 1356 / 9216, / (G - 1 = 3):
    # 452 / 9216, std = sqrt(452) / 96; A = [9, -23, 25, -11] / sqrt(452) = [0.42332, -1.08183, 1.17590, -0.51740]
    algo = SGPO()
    adv, returns = algo.advantages(rollout([0.0] * 4, NEGATIVE_STEPS))
    assert returns is None
    std = math.sqrt(452) / 96
    expected = torch.tensor([9.0, -23.0, 25.0, -11.0]) / 96 / (std + EPS)
    assert expected.tolist() == pytest.approx([0.42332, -1.08183, 1.17590, -0.51740], abs=1e-5)
    torch.testing.assert_close(adv, expected[:, None] * rollout([0.0] * 4, NEGATIVE_STEPS).response_mask)
    assert (adv[:, 0] == 0).all()  # the prompt token gets nothing
    # GRPO on the same group: every reward 0, every advantage 0
    assert (GRPO().advantages(rollout([0.0] * 4, NEGATIVE_STEPS))[0] == 0).all()


def test_scale_cancels_under_std_scaling_and_shows_without_it():
    r = rollout([0.0] * 4, NEGATIVE_STEPS)
    a5 = SGPO().advantages(r)[0]
    a9 = SGPO(SGPOConfig(scale=0.9)).advantages(r)[0]
    torch.testing.assert_close(a5, a9, atol=1e-5, rtol=1e-5)
    # centred only: [9, -23, 25, -11] / 96 * (scale / 0.5); scale 0.9 -> x 1.8
    adv = SGPO(SGPOConfig(scale=0.9, scale_rewards=False)).advantages(r)[0][:, 1]
    torch.testing.assert_close(adv, torch.tensor([9.0, -23.0, 25.0, -11.0]) / 96 * 1.8)


def test_threshold_moves_the_first_error():
    # threshold 0.85: row 0 [0.9, 0.8 x] -> 1/3; row 1 0; row 2 [0.7 x] -> 0; row 3 [0.6 x] -> 0.
    # graded (scale 0.5): [1/6, 0, 0, 0]; mean 1/24; deviations [3, -1, -1, -1] / 24;
    # var (9 + 3) / 576 / 3 = 1/144, std 1/12; A = [3, -1, -1, -1] / 24 * 12 = [1.5, -0.5, -0.5, -0.5]
    adv = SGPO(SGPOConfig(step_threshold=0.85)).advantages(rollout([0.0] * 4, NEGATIVE_STEPS))[0][:, 1]
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]) / (1 + 12 * EPS))


def test_mixed_group_keeps_grpo_advantages():
    # one correct response: the judge's scores are not read, the advantages are GRPO's to the bit
    rewards = [1.0, 0.0, 0.0, 0.0]
    r = rollout(rewards, NEGATIVE_STEPS)
    torch.testing.assert_close(SGPO().advantages(r)[0], GRPO().advantages(r)[0], atol=0, rtol=0)
    # by hand: mean 1/4, unbiased std sqrt((9/16 + 3/16) / 3) = 1/2: A = [3/2, -1/2, -1/2, -1/2]
    assert SGPO().advantages(r)[0][:, 1].tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], rel=1e-5)


def test_all_correct_group_gets_zero():
    adv, _ = SGPO().advantages(rollout([1.0] * 4, NEGATIVE_STEPS))
    assert (adv == 0).all()


def test_response_with_no_steps_scores_zero():
    # row 0 has no scored step: 0; row 1 [0.9, 0.1]: 1 of 2 -> 1/2, graded 0.25.
    # mean 0.125, deviations -+0.125, unbiased std sqrt(2 * 0.125^2 / 1) = 0.125 sqrt(2): A = -+1/sqrt(2)
    adv = SGPO().advantages(rollout([0.0, 0.0], [[], [0.9, 0.1]]))[0][:, 1]
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([-s, s]) / (1 + EPS / (0.125 * math.sqrt(2))))


def test_groups_are_separate_and_counted():
    # group 7: all negative, graded [1/3, 0] -> A = [1/sqrt(2), -1/sqrt(2)] (two values: +-the same);
    # group 3: mixed (GRPO); group 5: all negative with equal grades (1 and 1): no signal, A = 0
    r = rollout([0.0, 0.0, 1.0, 0.0, 0.0, 0.0], [[0.9, 0.8, 0.3], [0.2], [0.9], [0.1], [0.9], [0.6, 0.7]],
                group=[7, 7, 3, 3, 5, 5])
    algo = SGPO()
    adv = algo.advantages(r)[0][:, 1]
    s = 1 / math.sqrt(2)
    torch.testing.assert_close(adv, torch.tensor([s, -s, s, -s, 0.0, 0.0]), atol=1e-5, rtol=1e-5)
    stats = algo.step_metrics()
    assert stats["sgpo/groups"] == 3 and stats["sgpo/all_negative_groups"] == 2
    assert stats["sgpo/graded_groups"] == 1  # group 5 stays at 0
    # graded scores of the 4 rows in all-negative groups: 0.5 x [2/3, 0, 1, 1] -> mean 0.5 x 2/3 = 1/3
    assert stats["sgpo/graded_score_mean"] == pytest.approx(1 / 3)


def test_other_reward_terms_are_kept():
    # an all-negative group whose rewards already differ (e.g. a bonus): the grade adds to them.
    # rewards [0.2, 0] + 0.5 x [0, 1] = [0.2, 0.5]; centred (scale_rewards off): [-0.15, 0.15]
    r = rollout([0.2, 0.0], [[0.1], [0.9]], correct=[0, 0])
    adv = SGPO(SGPOConfig(scale_rewards=False)).advantages(r)[0][:, 1]
    torch.testing.assert_close(adv, torch.tensor([-0.15, 0.15]))


def test_missing_inputs_are_clear_errors():
    r = rollout([0.0, 0.0], [[0.9], [0.1]])
    with pytest.raises(DataError, match="accuracy"):
        SGPO().advantages(Rollout(**{**r.__dict__, "correct": None}))
    with pytest.raises(DataError, match="prm"):
        SGPO().advantages(Rollout(**{**r.__dict__, "step_rewards": None, "step_mask": None}))


def test_registered_under_its_name():
    from alignflow.plugins import sgpo

    found = {}
    sgpo.register_algorithms(lambda name, cls: found.update({name: cls}))
    assert found == {"sgpo": SGPO}
