"""length_penalty: Kimi k1.5's per-prompt length reward, lambda if correct, min(0, lambda) if wrong."""

import pytest

from alignflow.core.rewards import RewardSet
from alignflow.plugins.length_penalty import length_penalty

RIGHT, WRONG = "<answer>4</answer>", "<answer>5</answer>"


def test_hand_computed_group_with_another_prompt_interleaved():
    # prompt "a": lengths 10, 20, 30, 40 -> min 10, max 40, lambda = 0.5 - (len - 10) / 30
    #   = 0.5, 1/6, -1/6, -0.5; correct, wrong, correct, wrong -> 0.5, min(0, 1/6) = 0, -1/6, -0.5
    # prompt "b" (its rows between a's): lengths 7, 7 -> all 0, right or wrong
    prompts = ["a", "b", "a", "a", "b", "a"]
    completions = [RIGHT, RIGHT, WRONG, RIGHT, WRONG, WRONG]
    got = length_penalty(prompts, completions, answer=["4"] * 6, completion_lengths=[10, 7, 20, 30, 7, 40])
    assert got == pytest.approx([0.5, 0.0, 0.0, -1 / 6, 0.0, -0.5])


def test_wrong_answers_never_gain_and_correct_ones_can_lose():
    # lengths 3, 5, 9: lambda = 0.5, 0.5 - 2/6 = 1/6, -0.5
    got = length_penalty(["p"] * 3, [WRONG, WRONG, RIGHT], answer=["4"] * 3, completion_lengths=[3, 5, 9])
    assert got == pytest.approx([0.0, 0.0, -0.5])


def test_lengths_from_token_ids_then_characters_and_no_reference_is_none():
    # token ids: lengths 2 and 4 -> lambda 0.5 and -0.5
    ids = length_penalty(["q", "q"], [RIGHT, RIGHT], answer=["4", "4"], completion_ids=[[1, 2], [1, 2, 3, 4]])
    assert ids == [0.5, -0.5]
    # characters: "<answer>4</answer>" (18) and "<answer>4</answer> ok" (21)
    chars = length_penalty(["q", "q"], [RIGHT, RIGHT + " ok"], answer=["4", None])
    assert chars == [0.5, None]
    # a sample scored alone (the per-sample retry after a failed batch) has min = max: 0
    assert length_penalty(["q"], [WRONG], answer=["4"], completion_lengths=[30]) == [0.0]


def test_through_the_reward_set_beside_math_accuracy():
    from alignflow.plugins.math_accuracy import math_accuracy

    class Plugins:
        rewards = {"math_accuracy": math_accuracy, "length_penalty": length_penalty}

    rewards = RewardSet.from_refs([("math_accuracy", 1.0, {}), ("length_penalty", 0.5, {})], Plugins())
    out = rewards(["p"] * 2, [RIGHT, RIGHT], answer=["4", "4"], completion_lengths=[4, 8])
    # lambda = 0.5 and -0.5; totals 1 + 0.5 * 0.5 and 1 - 0.5 * 0.5
    assert out.total == pytest.approx([1.25, 0.75])
