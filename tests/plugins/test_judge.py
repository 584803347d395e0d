import pytest
import torch
from pydantic import ValidationError

from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.judge import Judge


def char_tokenizer():
    return build_char_tokenizer()


class Parser(Judge):
    """A judge without a model, to test parsing and rendering alone."""

    def _load(self):
        self.tokenizer = None


@pytest.mark.parametrize(
    ("text", "score"),
    [
        ("reasoning... VERDICT: yes", 1.0),
        ("verdict: NO", 0.0),
        ("VERDICT: no ... on reflection VERDICT: yes", 1.0),  # the last verdict counts
        ("VERDICT: maybe", None),
        ("no verdict at all", None),
    ],
)
def test_parse_yes_no(text, score):
    assert Parser(Judge.Config(path="unused")).parse(text) == score


def test_parse_numeric_scores():
    judge = Parser(Judge.Config(path="unused", pattern=r"SCORE:\s*([-\d.]+)", mapping=None))
    assert judge.parse("SCORE: 7.5") == 7.5
    assert judge.parse("SCORE: -.") is None
    assert judge.parse("nothing") is None


def test_config_rejects_unknown_placeholders_and_groupless_patterns():
    with pytest.raises(ValidationError, match="question"):
        Judge.Config(path="x", template="{question} {completion}")
    with pytest.raises(ValidationError, match="capture group"):
        Judge.Config(path="x", pattern="VERDICT: yes")


def test_render_fills_the_template():
    judge = Parser(Judge.Config(path="x", template="P={prompt} C={completion} A={answer}"))
    assert judge.render("1+1?", "{2}", "2") == "P=1+1? C={2} A=2"


@pytest.fixture(scope="module")
def tiny_lm(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(char_tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1)
    path = tmp_path_factory.mktemp("judge")
    Qwen2ForCausalLM(config).save_pretrained(path)
    char_tokenizer().save_pretrained(path)
    return path


def test_end_to_end_verdicts_are_numbers_or_none(tiny_lm):
    judge = Judge(Judge.Config(path=str(tiny_lm), max_new_tokens=8, batch_size=2, device="cpu",
                               template="q {prompt} a {completion} ref {answer} verdict"))
    prompts, completions = ["2+2?", "1+1?", "3+3?"], ["4", "11", "6"]
    scores = judge(prompts, completions, answer=["4", "2", "6"], tests=[None] * 3)
    assert len(scores) == 3 and all(s is None or s in (0.0, 1.0) for s in scores)
    # Batched left-padded generation equals generating each prompt alone.
    texts = [judge.render(p, c, a) for p, c, a in zip(prompts, completions, ["4", "2", "6"])]
    assert judge.generate(texts) == [judge.generate([t])[0] for t in texts]
