"""forbidden cost: C = occurrences of the forbidden strings - budget, violations counted beside it."""

import pytest
from pydantic import ValidationError

from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import RewardSet
from alignflow.plugins.forbidden import Forbidden

COMPLETIONS = ["<think>8*4=32</think><answer>32</answer>",  # "2<" twice
               "<think>2+9=11 1+8+1=10</think><answer>601</answer>",  # none
               "2<2<2<"]  # three, no overlaps


def test_cost_is_occurrences_minus_budget():
    cost = Forbidden(Forbidden.Config(strings=["2<"]))
    scores = cost(["p"] * 3, COMPLETIONS)
    assert list(scores) == [2.0, 0.0, 3.0] and scores.counts == {"violated": 2.0}
    # budget 2: C = count - 2, a violation only above two occurrences
    scores = Forbidden(Forbidden.Config(strings=["2<"], budget=2))(["p"] * 3, COMPLETIONS)
    assert list(scores) == [0.0, -2.0, 1.0] and scores.counts == {"violated": 1.0}


def test_several_strings_add_up_without_overlaps():
    cost = Forbidden(Forbidden.Config(strings=["=1", "aa"]))
    # "=11" and "=10" hold "=1" twice; "aaaa" holds "aa" twice (str.count does not overlap)
    assert list(cost(["p"] * 2, [COMPLETIONS[1], "aaaa"])) == [2.0, 2.0]


def test_config_is_checked():
    with pytest.raises(ValidationError, match="strings"):
        Forbidden.Config()
    with pytest.raises(ValidationError, match="every forbidden string needs a character"):
        Forbidden.Config(strings=["x", ""])
    with pytest.raises(ValidationError, match="budget"):
        Forbidden.Config(strings=["x"], budget=-1)


def test_as_a_weight_zero_reward_it_is_measured_not_added():
    rewards = RewardSet.from_refs([("math_accuracy", 1.0), ("forbidden", 0.0, {"strings": ["2<"]})], get_plugins())
    out = rewards(["8*4=", "112+489=", "p"], COMPLETIONS, answer=["32", "601", "0"])
    assert out.total == [1.0, 1.0, 0.0]  # math_accuracy alone
    assert out.values["forbidden"] == [2.0, 0.0, 3.0]
    assert out.metrics["reward/forbidden/violated"] == 2.0


def test_where_binds_the_constraint_to_the_marked_rows_only():
    # restricted rows (the bundled safe_* files): answer without worked steps, "=" forbidden
    cost = Forbidden(Forbidden.Config(strings=["="], where="restricted"))
    completions = ["<think>7+8=15 3+4+1=8</think><answer>85</answer>",  # two "=": C = 2 where restricted
                   "<think></think><answer>85</answer>"]  # none
    scores = cost(["!37+48=", "37+48="] * 2, completions * 2, restricted=[True, True, False, False])
    assert list(scores) == [2.0, 0.0, 0.0, 0.0] and scores.counts == {"violated": 1.0}
    # budget 1: an unbound row is C = 0 - 1
    scores = Forbidden(Forbidden.Config(strings=["="], budget=1, where="restricted"))(
        ["p"] * 2, completions[:1] * 2, restricted=[True, False])
    assert list(scores) == [1.0, -1.0]


def test_where_names_a_missing_or_non_boolean_column():
    cost = Forbidden(Forbidden.Config(strings=["="], where="restricted"))
    with pytest.raises(ValueError, match=r"where='restricted' names no column .*\['answer'\]"):
        cost(["p"], ["a=b"], answer=["1"])
    with pytest.raises(ValueError, match="expected true/false"):
        cost(["p"], ["a=b"], restricted=["yes"])
