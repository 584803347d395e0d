"""The transformers sampler: left padding, stop handling, log-probs, determinism, shared weights."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from alignflow.core.sampling import cut_at_stop, left_pad
from alignflow.core.settings import GenerationSettings
from alignflow.core.tokenizer import build_char_tokenizer
from alignflow.plugins.hf import HFSampler


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return Qwen2ForCausalLM(cfg).eval(), tok


def sampler(policy, **cfg):
    model, tok = policy
    s = HFSampler(HFSampler.Config(**cfg))
    s.load(model, tok)
    return s


def test_left_pad_and_cut_at_stop():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    rows, truncated = cut_at_stop(torch.tensor([[4, 2, 0, 0], [4, 5, 6, 7], [2, 0, 0, 0]]), {2})
    assert rows == [[4, 2], [4, 5, 6, 7], [2]] and truncated == [False, True, False]


def test_shapes_grouping_and_lengths(policy):
    s = sampler(policy, batch_size=5)
    prompts = [policy[1].encode("12+3="), policy[1].encode("7*8=")]
    gen = s.generate(prompts, n=3, gen=GenerationSettings(max_new_tokens=6, temperature=1.0), seed=1)
    assert gen.prompt_index == [0, 0, 0, 1, 1, 1]
    assert all(1 <= n <= 6 for n in gen.lengths)
    for ids, trunc in zip(gen.completion_ids, gen.truncated):
        assert trunc == (ids[-1] != policy[1].eos_token_id)
    assert [len(lp) for lp in gen.logprobs] == gen.lengths


def test_same_seed_same_samples_and_rng_untouched(policy):
    s = sampler(policy)
    prompts = [policy[1].encode("12+3=")]
    gen = GenerationSettings(max_new_tokens=8, temperature=1.0)
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a = s.generate(prompts, 4, gen, seed=7)
    after = torch.rand(1)
    b = s.generate(prompts, 4, gen, seed=7)
    assert a.completion_ids == b.completion_ids
    assert torch.equal(before, after)  # sampling does not consume the caller's random stream


def test_logprobs_match_a_teacher_forced_forward(policy):
    """Sampling log-probs equal log-softmax(logits / T) of a plain forward pass over prompt + completion."""
    model, tok = policy
    s = sampler(policy, batch_size=8)
    prompts = [tok.encode("9-4="), tok.encode("123+45=")]  # different lengths: left padding matters
    temperature = 0.7
    gen = s.generate(prompts, 2, GenerationSettings(max_new_tokens=5, temperature=temperature), seed=3)
    for i, ids in enumerate(gen.completion_ids):
        prompt = prompts[gen.prompt_index[i]]
        full = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(full).logits[0, len(prompt) - 1: -1] / temperature
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(gen.logprobs[i]), expected, atol=1e-4)


def test_greedy_is_independent_of_batching(policy):
    model, tok = policy
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=")]
    greedy = GenerationSettings(max_new_tokens=6, temperature=0.0)
    one = sampler(policy, batch_size=1).generate(prompts, 1, greedy, seed=0)
    many = sampler(policy, batch_size=3).generate(prompts, 1, greedy, seed=0)
    assert one.completion_ids == many.completion_ids


def test_update_weights_shares_the_module(policy):
    model, _ = policy
    s = sampler(policy)
    s.update_weights(model)
    assert s.model is model


def test_chunked_generation_concatenates_in_prompt_order(policy):
    """Generating prompt chunks and joining them keeps each completion with its prompt."""
    from alignflow.core.sampling import Generation

    model, tok = policy
    s = sampler(policy)
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=")]
    greedy = GenerationSettings(max_new_tokens=5, temperature=0.0)
    whole = s.generate(prompts, 2, greedy, seed=0)
    joined = Generation.concat([(0, s.generate(prompts[:2], 2, greedy, seed=0)),
                                (2, s.generate(prompts[2:], 2, greedy, seed=0))])
    assert joined.prompt_index == whole.prompt_index == [0, 0, 1, 1, 2, 2]
    assert joined.completion_ids == whole.completion_ids and joined.texts == whole.texts
    assert [len(lp) for lp in joined.logprobs] == joined.lengths
