import pytest

from alignflow.plugins.format import format_reward


@pytest.mark.parametrize(
    ("completion", "score"),
    [
        ("<think>\nreason\n</think>\n<answer>\n42\n</answer>", 1.0),
        ("  <think>a</think><answer>b</answer>\n\n", 1.0),
        ("<think>a</think><answer>b</answer> trailing", 0.0),
        ("<answer>b</answer><think>a</think>", 0.0),
        ("<think>a</think>text<answer>b</answer>", 0.0),
        ("<think>a</think><think>c</think><answer>b</answer>", 0.0),
        ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
        ("<think>a <answer>x</answer></think><answer>b</answer>", 0.0),
        ("<think>a</think>", 0.0),
        ("plain text", 0.0),
    ],
)
def test_format_reward(completion, score):
    assert format_reward(["p"], [completion], answer=["unused"]) == [score]
