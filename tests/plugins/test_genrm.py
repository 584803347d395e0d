"""genrm reward: P(yes) / (P(yes) + P(no)) at the verdict position, direct and averaged over sampled rationales."""

import math
from types import SimpleNamespace

import pytest
import torch
from pydantic import ValidationError

from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.genrm import GenerativeVerifier, cut_rationale, verdict_tokens

TOK = build_char_tokenizer()
SPACE, Y, N = (TOK(t, add_special_tokens=False).input_ids[0] for t in (" ", "Y", "N"))
PROMPTS, COMPLETIONS = ["3+4=", "12+9="], ["<answer>7</answer>", "<think>2+9=11 1+0+1=2</think><answer>21</answer>"]


def test_verdicts_part_at_their_first_differing_token():
    assert verdict_tokens(TOK, " Yes", " No") == ([SPACE], Y, N)
    with pytest.raises(ValueError, match="no token tells them apart"):
        verdict_tokens(TOK, " Y", " Yes")


def test_a_rationale_ends_where_a_verdict_starts_else_at_a_stop():
    assert cut_rationale([5, 6, SPACE, 7, SPACE, N, 9], [SPACE], (Y, N), {0, 1}) == [5, 6, SPACE, 7]
    assert cut_rationale([5, SPACE, 7, 1, 0, 0], [SPACE], (Y, N), {0, 1}) == [5, SPACE, 7]
    assert cut_rationale([5, 6, SPACE], [SPACE], (Y, N), {0, 1}) == [5, 6, SPACE]


class FixedLogits(torch.nn.Module):
    """Yes's logit 0.1 x the real tokens read so far, no's 1, every other token's 0: the scores can be recounted."""

    def forward(self, input_ids, attention_mask, position_ids):
        logits = torch.zeros(*input_ids.shape, len(TOK))
        logits[..., Y] = 0.1 * attention_mask.cumsum(-1)
        logits[..., N] = 1.0
        return SimpleNamespace(logits=logits)


def stub(model, **config) -> GenerativeVerifier:
    verifier = object.__new__(GenerativeVerifier)
    verifier.config = GenerativeVerifier.Config(path="unused", **config)
    verifier.device, verifier.tokenizer, verifier.model = "cpu", TOK, model
    verifier.prefix, verifier.yes_id, verifier.no_id = verdict_tokens(TOK, verifier.config.yes, verifier.config.no)
    return verifier


def test_direct_score_is_the_softmax_over_the_two_verdict_logits_after_the_prefix():
    verifier = stub(FixedLogits(), batch_size=2)
    lengths = [len(c) + 1 for c in verifier.contexts(PROMPTS, COMPLETIONS)]  # the context, then the prefix " "
    assert lengths[0] != lengths[1]  # one left-padded batch of two lengths
    assert verifier(PROMPTS, COMPLETIONS) == pytest.approx([1 / (1 + math.exp(1.0 - 0.1 * n)) for n in lengths],
                                                          abs=1e-6)
    short = stub(FixedLogits(), max_length=8)  # cut from the left: 8 tokens read
    assert short(PROMPTS, COMPLETIONS) == pytest.approx([1 / (1 + math.exp(1.0 - 0.8))] * 2, abs=1e-6)


@pytest.fixture(scope="module")
def tiny_verifier(tmp_path_factory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(TOK), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, eos_token_id=1,
                         max_position_embeddings=256)
    path = tmp_path_factory.mktemp("genrm")
    Qwen2ForCausalLM(config).save_pretrained(path)
    TOK.save_pretrained(path)
    return path


def by_hand(verifier, ids: list[int]) -> float:
    """The verdict probability of one unpadded sequence, from its logits."""
    with torch.inference_mode():
        logits = verifier.model(torch.tensor([ids + [SPACE]])).logits[0, -1]
    return torch.softmax(logits[[Y, N]], -1)[0].item()


def test_batched_direct_scores_equal_each_sequence_scored_alone(tiny_verifier):
    verifier = GenerativeVerifier(GenerativeVerifier.Config(path=str(tiny_verifier), batch_size=2, device="cpu"))
    text = "12+9=" + COMPLETIONS[1] + " Is the answer correct (Yes/No)?"
    assert verifier.contexts(PROMPTS, COMPLETIONS)[1] == TOK(text).input_ids
    scores = verifier(PROMPTS, COMPLETIONS)  # two lengths in one left-padded batch
    assert scores == pytest.approx([by_hand(verifier, c) for c in verifier.contexts(PROMPTS, COMPLETIONS)],
                                   abs=1e-5)
    assert all(0 < s < 1 for s in scores)


def test_cot_averages_the_verdicts_after_each_sampled_rationale_and_is_seeded(tiny_verifier):
    config = dict(path=str(tiny_verifier), mode="cot", votes=3, max_new_tokens=6, batch_size=4, device="cpu")
    verifier = GenerativeVerifier(GenerativeVerifier.Config(**config))
    scores = verifier(PROMPTS, COMPLETIONS)
    state = torch.random.get_rng_state()
    assert verifier(PROMPTS, COMPLETIONS) == scores  # same seed, same rationales, same scores
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG is left as it was
    contexts = verifier.contexts(PROMPTS, COMPLETIONS)
    why = verifier.rationales(contexts)
    assert len(why) == 6 and all(len(r) <= 6 for r in why)
    assert len({tuple(r) for r in why}) > 1  # sampled, not greedy
    expected = [sum(by_hand(verifier, contexts[i] + r) for r in why[3 * i: 3 * i + 3]) / 3 for i in range(2)]
    assert scores == pytest.approx(expected, abs=1e-5)


def test_config_names_bad_values():
    with pytest.raises(ValidationError, match="must use"):
        GenerativeVerifier.Config(path="x", template="{completion} correct?")
    with pytest.raises(ValidationError, match="votes"):
        GenerativeVerifier.Config(path="x", votes=0)
