import pytest
import torch

from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.reward_model import RewardModel


def char_tokenizer():
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(char_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=1, pad_token_id=0)
    path = tmp_path_factory.mktemp("rm")
    Qwen2ForSequenceClassification(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


PROMPTS = ["what is 2+2? ", "q: ", "say hi. "]
COMPLETIONS = ["4", "a much longer answer, with commas", "hi"]


def direct_scores(model, tokenizer):
    """Score each text alone: the head applied to the last token's hidden state."""
    out = []
    for p, c in zip(PROMPTS, COMPLETIONS):
        ids = torch.tensor([tokenizer(p + c)["input_ids"]])
        with torch.no_grad():
            hidden = model.model(input_ids=ids).last_hidden_state[0, -1]
            out.append(model.score(hidden).item())
    return out


@pytest.mark.parametrize(
    ("batch_size", "padding_side"), [(3, "right"), (3, "left"), (2, "left"), (1, "right")],
    ids=["full-right", "full-left", "split-left", "single"],
)
def test_scores_match_a_direct_forward_for_any_batching(checkpoint, batch_size, padding_side):
    reward = RewardModel(RewardModel.Config(path=str(checkpoint), batch_size=batch_size, device="cpu"))
    reward.tokenizer.padding_side = padding_side
    expected = direct_scores(reward.model, reward.tokenizer)
    got = reward(PROMPTS, COMPLETIONS, answer=["ignored"] * 3)
    assert len(set(round(s, 4) for s in expected)) == 3  # the texts really score differently
    assert got == pytest.approx(expected, abs=1e-5)


def test_long_text_is_cut_from_the_left(checkpoint):
    reward = RewardModel(RewardModel.Config(path=str(checkpoint), max_length=5, device="cpu"))
    assert reward(["x" * 50], ["hello"]) == pytest.approx(reward([""], ["hello"]), abs=1e-5)
