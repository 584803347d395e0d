"""The transformers sampler: left padding, stop handling, log-probs, determinism, shared weights, and its
decode loop against transformers' `generate`."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from alignflow.core.sampling import cut_at_stop, left_pad
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.hf import HFSampler


@pytest.fixture(scope="module")
def policy():
    torch.manual_seed(0)
    tok = build_char_tokenizer()
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return Qwen2ForCausalLM(cfg).eval(), tok


ENGINES = pytest.mark.parametrize("engine", ["packed", "transformers"])


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


@ENGINES
def test_same_seed_same_samples_and_rng_untouched(policy, engine):
    s = sampler(policy, engine=engine)
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


@ENGINES
def test_logprobs_match_a_teacher_forced_forward(policy, engine):
    """Sampling log-probs equal log-softmax(logits / T) of a plain forward pass over prompt + completion."""
    model, tok = policy
    s = sampler(policy, engine=engine, batch_size=8)
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


@ENGINES
def test_greedy_is_independent_of_batching(policy, engine):
    model, tok = policy
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=")]
    greedy = GenerationSettings(max_new_tokens=6, temperature=0.0)
    one = sampler(policy, engine=engine, batch_size=1).generate(prompts, 1, greedy, seed=0)
    many = sampler(policy, engine=engine, batch_size=3).generate(prompts, 1, greedy, seed=0)
    assert one.completion_ids == many.completion_ids


def test_update_weights_shares_the_module(policy):
    model, _ = policy
    s = sampler(policy)
    s.update_weights(model)
    assert s.model is model


@ENGINES
def test_chunked_generation_concatenates_in_prompt_order(policy, engine):
    """Generating prompt chunks and joining them keeps each completion with its prompt."""
    from alignflow.core.sampling import Generation

    model, tok = policy
    s = sampler(policy, engine=engine)
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=")]
    greedy = GenerationSettings(max_new_tokens=5, temperature=0.0)
    whole = s.generate(prompts, 2, greedy, seed=0)
    joined = Generation.concat([(0, s.generate(prompts[:2], 2, greedy, seed=0)),
                                (2, s.generate(prompts[2:], 2, greedy, seed=0))])
    assert joined.prompt_index == whole.prompt_index == [0, 0, 1, 1, 2, 2]
    assert joined.completion_ids == whole.completion_ids and joined.texts == whole.texts
    assert [len(lp) for lp in joined.logprobs] == joined.lengths


@ENGINES
def test_greedy_matches_transformers_generate(policy, engine):
    """The decode loop's greedy tokens and log-probs are transformers' `generate` ones (left padding included)."""
    model, tok = policy
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=")]
    gen = sampler(policy, engine=engine).generate(prompts, 1, GenerationSettings(max_new_tokens=7, temperature=0.0), seed=0)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=7, do_sample=False,
                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                         return_dict_in_generate=True, output_logits=True)
    want, _ = cut_at_stop(out.sequences[:, ids.shape[1]:], {tok.eos_token_id})
    assert gen.completion_ids == want
    logp = torch.stack(out.logits, 1).log_softmax(-1)
    for i, c in enumerate(want):
        torch.testing.assert_close(torch.tensor(gen.logprobs[i]), logp[i, torch.arange(len(c)), c], atol=1e-5, rtol=0)


@ENGINES
@pytest.mark.parametrize("batch_step", [1, 4])
def test_rows_that_stop_leave_the_batch_without_changing_the_rest(policy, monkeypatch, engine, batch_step):
    """With many stop tokens rows end at different steps; dropping them from the batch (and their KV rows)
    keeps every other row's log-probs those of a teacher-forced forward. The batch shrinks to a multiple of
    BATCH_STEP rows: stopped rows fill it, decoded and never recorded."""
    import alignflow.plugins.hf as hf

    model, tok = policy
    s = sampler(policy, engine=engine)
    s.stop_ids = set(range(0, len(tok), 3))  # a third of the vocabulary stops a row
    monkeypatch.setattr(hf, "COMPACT_AT", 0.01)  # drop stopped rows at every step
    monkeypatch.setattr(hf, "BATCH_STEP", batch_step)
    from transformers import DynamicCache

    from alignflow.core.train.decoder import PackedDecoder

    kept = []
    cls, name = (PackedDecoder, "keep") if engine == "packed" else (DynamicCache, "batch_select_indices")
    select = getattr(cls, name)
    monkeypatch.setattr(cls, name, lambda cache, idx: kept.append(len(idx)) or select(cache, idx))
    prompts = [tok.encode("12+3="), tok.encode("987-654=")]
    gen = s.generate(prompts, 6, GenerationSettings(max_new_tokens=12, temperature=1.0), seed=5)
    assert kept and kept == sorted(kept, reverse=True) and kept[-1] < 12  # the batch did shrink
    assert all(k % batch_step == 0 for k in kept) and len(set(kept)) == len(kept)
    lengths = gen.lengths
    assert len(set(lengths)) > 2 and min(lengths) < 12  # rows did stop at different steps
    for i, ids in enumerate(gen.completion_ids):
        assert all(t not in s.stop_ids for t in ids[:-1]) and (ids[-1] in s.stop_ids) != gen.truncated[i]
        prompt = prompts[gen.prompt_index[i]]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: -1]
        expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(gen.logprobs[i]), expected, atol=1e-4, rtol=0)


@ENGINES
def test_top_p_keeps_the_nucleus(policy, engine):
    """top_p small enough leaves only the most likely token: sampling then is greedy decoding."""
    _, tok = policy
    prompts = [tok.encode("1+1="), tok.encode("250*3=")]
    s = sampler(policy, engine=engine)
    greedy = s.generate(prompts, 1, GenerationSettings(max_new_tokens=6, temperature=0.0), seed=0)
    nucleus = s.generate(prompts, 3, GenerationSettings(max_new_tokens=6, temperature=1.0, top_p=1e-6), seed=1)
    assert nucleus.completion_ids == [c for c in greedy.completion_ids for _ in range(3)]


def test_sampling_follows_the_distribution():
    """The inverse-CDF draw picks token k with probability p_k (and never a zero-probability one)."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.2]]).expand(40_000, 4)
    token, lp = HFSampler.pick(probs.log(), GenerationSettings(temperature=1.0), torch.Generator().manual_seed(0))
    freq = torch.bincount(token, minlength=4).float() / len(token)
    torch.testing.assert_close(freq, probs[0], atol=0.01, rtol=0)
    torch.testing.assert_close(lp, probs[0, token].log())


def test_one_decode_loop_per_token_budget(policy, monkeypatch):
    """By default all prompts go through one decode loop; `max_batch_tokens` splits them when the rows x
    (prompt + max_new_tokens) budget is smaller, and `batch_size` caps the rows per loop (whole prompts, at
    least one: a prompt's `n` rows share its prefill)."""
    _, tok = policy
    prompts = [tok.encode(p) for p in ("1+1=", "250*3=", "77-8=", "5*5=")]
    gen = GenerationSettings(max_new_tokens=4, temperature=1.0)

    def loops(**cfg):
        s = sampler(policy, **cfg)
        calls = []
        real = s.decode
        monkeypatch.setattr(s, "decode", lambda prompts, *a: calls.append(len(prompts)) or real(prompts, *a))
        s.generate(prompts, 4, gen, seed=0)
        return calls

    assert loops() == [4]
    assert loops(max_batch_tokens=10 * 8) == [2, 2]  # width 6 + 4 = 10 tokens a row: 8 rows, 2 prompts of 4
    assert loops(batch_size=5) == [1, 1, 1, 1]


class SwitchAt:
    """Newer weights `new` once `after` checks have passed: what a rollout worker's `Preempt` does under
    `async_weights: partial` (the check at the start of `generate` counts as one, then one per decode step)."""

    def __init__(self, model, new, after):
        self.model, self.new, self.after, self.checks, self.version = model, new, after, 0, 0

    def due(self):
        self.checks += 1
        return self.version == 0 and self.checks > self.after

    def refresh(self):
        self.model.load_state_dict(self.new)
        self.version = 1
        return 1


@ENGINES
def test_a_preempted_generation_goes_on_from_its_tokens_on_the_new_weights(policy, engine):
    """Partial rollouts: the rows still running when new weights arrive keep the tokens (and log-probs) the old
    weights sampled, and continue on the new ones: their later log-probs are the new model's, teacher-forced on
    the same tokens, and each token's version says which weights sampled it."""
    import copy

    model, tok = copy.deepcopy(policy[0]), policy[1]
    old = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    gen = GenerationSettings(max_new_tokens=8, temperature=1.0)
    prompts = [tok.encode("1+2="), tok.encode("30+4=")]
    s = HFSampler(HFSampler.Config(engine=engine))
    s.load(model, tok)
    plain = s.generate(prompts, 2, gen, seed=3)  # the old weights throughout
    s.preempt = SwitchAt(model, new, after=4)  # due at the 4th decode step: 4 tokens sampled by version 0
    g = s.generate(prompts, 2, gen, seed=3)
    continued = [i for i, c in enumerate(g.completion_ids) if len(c) > 4]
    assert continued and s.preempt.version == 1
    for i, (c, v, lp) in enumerate(zip(g.completion_ids, g.versions, g.logprobs)):
        head = min(len(c), 4)
        assert v == [0] * head + [1] * (len(c) - head)
        assert c[:head] == plain.completion_ids[i][:head] and lp[:head] == plain.logprobs[i][:head]
        assert g.truncated[i] == (len(c) == 8 and c[-1] != tok.eos_token_id)
    with torch.no_grad():  # the new weights' log-probs of the continued tokens, teacher-forced
        for i in continued:
            ids = prompts[i // 2] + g.completion_ids[i]
            logp = model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            n = len(prompts[i // 2])
            want = [logp[n + t - 1, ids[n + t]].item() for t in range(4, len(g.completion_ids[i]))]
            assert g.logprobs[i][4:] == pytest.approx(want, abs=1e-4)
