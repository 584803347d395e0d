from alignflow.plugins.length import LengthPenalty


def test_length_penalty_is_linear_beyond_target():
    reward = LengthPenalty(LengthPenalty.Config(target=10, coefficient=0.5))
    got = reward(["p"] * 4, ["x"] * 4, completion_lengths=[0, 10, 15, 30])
    assert got == [0.0, 0.0, -0.25, -1.0]


def test_length_penalty_counts_characters_without_token_lengths():
    reward = LengthPenalty(LengthPenalty.Config(target=2, coefficient=1.0))
    assert reward(["p"], ["abcd"], answer=["ignored"]) == [-1.0]
