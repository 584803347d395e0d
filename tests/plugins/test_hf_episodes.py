"""The hf sampler's episode caches: a multi-turn batch decoded with each episode's KV cache kept between turns gives
the ids and log-probs of one that prefills every turn's whole context; a prompt that does not extend the cache
reuses only what it shares with it; caches are freed when episodes end."""

from contextlib import contextmanager

import pytest
import torch

from alignflow.core.environments import Environment, Step
from alignflow.core.environments.episodes import Episodes
from alignflow.core.episode_cache import EpisodeCaches, Kept, shared_prefix
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.plugins.hf import HFSampler

# Log-probs are compared at this tolerance, not exactly: a cached token's keys and values were computed in the
# turn that sampled it (a one-token step), an uncached one's in the next turn's prefill (one attention over the
# whole context); the same fp32 arithmetic in ops of other shapes rounds differently (~1e-7 per value).
LOGPROB_ATOL = 1e-5
# the stop token's logit bias (temperature: bias): sampled, turns of ~6 tokens; greedy on the random tiny model, 0.6
# stops every turn at once (8 turns of the stop token alone: each the argmax of a resumed prefill) and 0.5 writes on
# in some contexts (turns of 24 tokens, decoded on a resumed cache, in episodes of 2 turns)
SETTINGS = [(1.0, 4.0), (0.0, 0.6), (0.0, 0.5)]
SAMPLED_BIAS = 4.0
# episodes of one batch that end after 1, 3 and 8 turns: the long ones go on decoding as the short ones stop
ROWS = [{"prompt": "12+34=", "turns": 1}, {"prompt": "5*6=", "turns": 3}, {"prompt": "7-2=", "turns": 8}]


class Countdown(Environment):
    """Answers each turn with a short line until the row's number of turns is played."""

    def reset(self, row, seed):
        self.turns = row["turns"]
        return row["prompt"]

    def step(self, turn):
        if turn.index + 1 >= self.turns:
            return Step(reward=1.0, done=True)
        return Step(f"go on ({turn.index})", reward=0.0)


@pytest.fixture(scope="module")
def policy(tiny_model):
    """The tiny model with a bias on its stop token (`stop_bias`: a random model rarely stops, and an unfinished
    turn ends its episode), and its tokenizer."""
    folder = tiny_model()
    model, tok = load_model(folder).eval(), load_tokenizer(folder)
    head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
    model.lm_head = head
    return model, tok


@contextmanager
def stop_bias(policy, value: float):
    model, tok = policy
    with torch.no_grad():
        model.lm_head.bias[tok.eos_token_id] = value
    try:
        yield
    finally:
        with torch.no_grad():
            model.lm_head.bias[tok.eos_token_id] = 0.0


def sampler(policy, **cfg):
    s = HFSampler(HFSampler.Config(**{"engine": "packed", **cfg}))
    s.load(*policy)
    return s


def play(s, policy, gen, seed=3, n=3):
    return Episodes(Countdown, Countdown.Config(), max_turns=8).generate(s, policy[1], ROWS, n, gen, seed)


@pytest.mark.parametrize("engine", ["packed", "transformers"])
@pytest.mark.parametrize("temperature,bias", SETTINGS)
@pytest.mark.parametrize("batch_step", [16, 1])  # 1: rows that stop leave the batch at once (their caches with them)
def test_cached_turns_give_the_ids_and_logprobs_of_full_prefills(policy, one_thread, monkeypatch, engine,
                                                                   temperature, bias, batch_step):
    monkeypatch.setattr("alignflow.plugins.hf.BATCH_STEP", batch_step)
    gen = GenerationSettings(max_new_tokens=24, temperature=temperature)
    full, cached = sampler(policy, engine=engine, episode_cache=False), sampler(policy, engine=engine)
    with stop_bias(policy, bias):
        a, b = play(full, policy, gen), play(cached, policy, gen)
    assert a.episodes["turns"] == b.episodes["turns"] and max(a.episodes["turns"]) >= 2  # multi-turn indeed
    assert a.completion_ids == b.completion_ids and a.loss_mask == b.loss_mask
    for x, y in zip(a.logprobs, b.logprobs):
        torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=LOGPROB_ATOL)
    # the cache did its work: later turns prefilled only the environment's reply and the turn's stop token
    assert full.caches.reused == 0 and cached.caches.reused > 0
    assert full.caches.prefilled == cached.caches.prefilled + cached.caches.reused  # the same prompts, split
    assert cached.caches.kept == {}  # every episode's cache freed when it ended


@pytest.mark.parametrize("engine", ["packed", "transformers"])
def test_a_prompt_that_does_not_extend_the_cache_is_prefilled_from_where_it_differs(policy, one_thread, engine):
    tok = policy[1]
    gen = GenerationSettings(max_new_tokens=12, temperature=1.0)
    prompts = [tok("12+34=").input_ids, tok("5*6=").input_ids, tok("7-2=").input_ids]
    s = sampler(policy, engine=engine)
    with s.continuing(["a", "b", "c"]), stop_bias(policy, SAMPLED_BIAS):
        first = s.generate(prompts, 1, gen, seed=1)
    assert set(s.caches.kept) == {"a", "b", "c"}
    reply = tok("ok, next:").input_ids
    extended = [p + c + reply for p, c in zip(prompts, first.completion_ids)]
    rewritten = [extended[0],
                 extended[1][:2] + [tok("#").input_ids[0]] + extended[1][3:],  # a template rewrote token 2
                 [tok("#").input_ids[0]] + extended[2][1:]]  # ... or the very first: nothing reused
    known = [len(s.caches.kept[k]) for k in ("a", "b", "c")]
    before = s.caches.reused
    with s.continuing(["a", "b", "c"]):
        second = s.generate(rewritten, 1, gen, seed=2)
    assert s.caches.reused - before == known[0] + 2 + 0
    reference = sampler(policy, engine=engine, episode_cache=False).generate(rewritten, 1, gen, seed=2)
    assert second.completion_ids == reference.completion_ids
    for x, y in zip(reference.logprobs, second.logprobs):
        torch.testing.assert_close(torch.tensor(y), torch.tensor(x), rtol=0, atol=LOGPROB_ATOL)


def test_caches_are_freed_when_episodes_end_and_when_the_weights_change(policy, one_thread):
    tok, gen = policy[1], GenerationSettings(max_new_tokens=8, temperature=1.0)
    s = sampler(policy)
    with s.continuing(["a", "b"]):
        s.generate([tok("1+1=").input_ids, tok("2+2=").input_ids], 1, gen, seed=0)
    s.end_episodes(["a"])
    assert set(s.caches.kept) == {"b"}
    s.update_weights(policy[0])
    assert s.caches.kept == {}
    s.generate([tok("1+1=").input_ids], 1, gen, seed=0)  # a call outside `continuing` keeps nothing
    assert s.caches.kept == {}


@pytest.mark.parametrize("dtype,setting,kept", [("fp32", None, True), ("bf16", None, False), ("fp32", False, False),
                                                ("bf16", True, True)])
def test_unset_the_cache_is_kept_where_decoding_is_fp32(policy, one_thread, dtype, setting, kept):
    """bf16's rounding can change a sampled token between a kept cache and a full prefill: unset, it is off there."""
    tok = policy[1]
    s = sampler(policy, dtype=dtype, episode_cache=setting)
    with s.continuing(["a"]):
        s.generate([tok("1+1=").input_ids], 1, GenerationSettings(max_new_tokens=4, temperature=1.0), seed=0)
    assert bool(s.caches.kept) == kept


def test_an_episode_ended_by_a_failing_environment_frees_its_cache(policy, one_thread):
    class Failing(Countdown):
        def step(self, turn):
            if turn.index == 1 and self.turns == 3:
                raise RuntimeError("the environment broke")
            return super().step(turn)

    s = sampler(policy)
    with stop_bias(policy, SAMPLED_BIAS):
        g = Episodes(Failing, Failing.Config(), max_turns=8).generate(
            s, policy[1], ROWS, 1, GenerationSettings(max_new_tokens=24, temperature=1.0), seed=0)
    assert "error" in g.episodes["ended"] and s.caches.kept == {}


def test_what_a_cache_gives_a_prompt():
    assert shared_prefix([1, 2, 3], [1, 2, 3, 4]) == 3 and shared_prefix([1, 2, 3], [1, 9, 3]) == 1
    assert shared_prefix([5], [6]) == 0
    kv = [torch.arange(8.0).view(1, 4, 2)]
    caches = EpisodeCaches()
    for prompt, reused in [([1, 2, 3, 4, 5], 4), ([1, 2, 9, 4], 2), ([1, 2, 3, 4], 3), ([7, 2, 3, 4, 5], None)]:
        caches.put("e", Kept([1, 2, 3, 4], kv, kv))
        past = caches.past("e", prompt)
        assert (None if past is None else len(past)) == reused
        if past is not None:
            assert past.tokens == prompt[:reused] and past.keys[0].shape == (1, reused, 2)
    assert caches.kept == {}  # an entry is taken by the turn that uses it
