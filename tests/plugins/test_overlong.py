import pytest
from pydantic import ValidationError

from alignflow.plugins.overlong import Overlong


def test_overlong_follows_dapo_eq13_in_tokens():
    reward = Overlong(Overlong.Config(max_length=20, cache_length=8))
    lengths = [0, 12, 13, 16, 20, 21, 100]
    got = reward(["p"] * 7, ["x"] * 7, completion_lengths=lengths)
    # (L_max - L_cache - |y|) / L_cache on (12, 20]; -1 beyond L_max.
    assert got == [0.0, 0.0, -1 / 8, -0.5, -1.0, -1.0, -1.0]


def test_overlong_uses_completion_ids_then_characters():
    reward = Overlong(Overlong.Config(max_length=4, cache_length=2))
    assert reward(["p"], ["abcdefgh"], completion_ids=[[1, 2, 3]]) == [-0.5]
    assert reward(["p"], ["abc"]) == [-0.5]


def test_overlong_defaults_are_dapos_and_config_is_checked():
    assert Overlong.Config().max_length == 20480 and Overlong.Config().cache_length == 4096
    with pytest.raises(ValidationError, match="cache_length"):
        Overlong.Config(max_length=4, cache_length=8)
    with pytest.raises(ValidationError):
        Overlong.Config(max_len=4)
