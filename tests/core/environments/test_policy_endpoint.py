"""The policy endpoint: episodes driven through an OpenAI-compatible server by programs written against the `openai`
SDK get the ids, masks and log-probs in-process episodes get; calls are batched; history rewritten by the harness
starts a new sample; malformed requests get OpenAI's error shape; a hanging harness times out."""

import asyncio
import time

import httpx
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from alignflow.core.environments import Environment, EpisodeError, Step
from alignflow.core.environments.contract import Limits
from alignflow.core.environments.agents import AgentEnvironment
from alignflow.core.environments.episodes import Episodes, episode_metrics
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.core.train.models import token_logprobs
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.plugins.hf import HFSampler

pytestmark = pytest.mark.system  # each generate starts the endpoint's HTTP server
ROWS = [{"prompt": "12+34="}, {"prompt": "5*6="}]
REPLY = "\nturn {} seen, go on:\n"


def policy():
    """A random tiny Qwen2 whose turns end after ~6 tokens (a bias on the stop token)."""
    torch.manual_seed(0)
    tok = build_char_tokenizer(512)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    model = Qwen2ForCausalLM(cfg).eval()
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 4.0
    model.lm_head = head
    return model, tok


class CountingSampler(HFSampler):
    """The hf sampler, counting the rows of each generate call."""

    def generate(self, prompt_ids, n, gen, seed):
        self.batches = getattr(self, "batches", []) + [len(prompt_ids)]
        return super().generate(prompt_ids, n, gen, seed)


@pytest.fixture(scope="module")
def tiny():
    model, tok = policy()
    sampler = CountingSampler(HFSampler.Config())
    sampler.load(model, tok)
    return model, tok, sampler


class Echo(Environment):
    """In-process: answers every turn with a line of text; ends at max_turns."""

    def step(self, turn):
        return Step(REPLY.format(turn.index), reward=0.5)


class EchoAgent(AgentEnvironment):
    """The same episode, driven from outside with the `openai` SDK: three turns, the same replies."""

    async def rollout(self, row, seed, policy):
        async with policy.client() as client:
            messages = [{"role": "user", "content": row["prompt"]}]
            for t in range(3):
                r = await client.chat.completions.create(model="any", messages=messages)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": REPLY.format(t)}]
        return 1.5


def episodes(env, **kw):
    return Episodes(env, env.Config(**kw) if issubclass(env, AgentEnvironment) else None, max_turns=3,
                    max_tokens=400)


def trainer_logprobs(model, tok, g):
    samples = Samples(prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, logprobs=g.logprobs,
                      group=g.prompt_index, reward=g.episodes["reward"], correct=[False] * len(g),
                      truncated=g.truncated, values={}, loss_mask=g.loss_mask)
    batch = to_batch(samples, tok.pad_token_id, 400)
    mask = batch.rollout.response_mask.bool()
    return token_logprobs(model, batch.input_ids, batch.attention_mask, mask.float())[mask], \
        batch.rollout.sampler_logprobs[mask]


def test_an_sdk_driven_episode_equals_the_in_process_one(tiny):
    model, tok, sampler = tiny
    greedy = GenerationSettings(max_new_tokens=24, temperature=0.0)
    inside = episodes(Echo).generate(sampler, tok, ROWS, 2, greedy, seed=3)
    sampler.batches = []
    together = {"batch_wait_s": 30.0}  # a batch closes when every episode's call waits
    outside = episodes(EchoAgent, **together).generate(sampler, tok, ROWS, 2, greedy, seed=3)
    assert outside.prompt_ids == inside.prompt_ids
    assert outside.completion_ids == inside.completion_ids
    assert outside.loss_mask == inside.loss_mask
    torch.testing.assert_close(torch.tensor(sum(outside.logprobs, [])), torch.tensor(sum(inside.logprobs, [])),
                               rtol=0, atol=2e-5)
    assert outside.episodes["reward"] == [1.5] * 4 and outside.episodes["turns"] == [3] * 4
    # every running episode's call joined one batch: 3 sampler calls of 4 rows, not 12 of one
    assert sampler.batches == [4, 4, 4]


def test_sampled_episodes_train_on_the_ids_the_endpoint_drew(tiny):
    model, tok, sampler = tiny
    g = episodes(EchoAgent).generate(sampler, tok, ROWS, 2, GenerationSettings(max_new_tokens=24), seed=5)
    trainer, drawn = trainer_logprobs(model, tok, g)
    torch.testing.assert_close(trainer, drawn, rtol=0, atol=2e-5)
    reply = [t for t, m in zip(g.completion_ids[0], g.loss_mask[0]) if not m]
    assert tok.decode(reply) == REPLY.format(0) + REPLY.format(1)


class Forgetful(AgentEnvironment):
    """Keeps only the last exchange after turn 1: its third call does not extend the second."""

    async def rollout(self, row, seed, policy):
        async with policy.client() as client:
            messages = [{"role": "user", "content": row["prompt"]}]
            for t in range(3):
                r = await client.chat.completions.create(model="any", messages=messages)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": REPLY.format(t)}]
                if t == 1:
                    messages = messages[-1:]
        return 1.0


def test_a_rewritten_history_starts_a_new_sample_of_the_episode(tiny):
    model, tok, sampler = tiny
    g = episodes(Forgetful).generate(sampler, tok, ROWS[:1], 2, GenerationSettings(max_new_tokens=24), seed=1)
    assert len(g) == 4 and g.prompt_index == [0, 0, 0, 0]
    assert g.episodes["sample"] == [0, 1, 0, 1] and g.episodes["final"] == [False, True, False, True]
    assert g.episodes["turns"] == [2, 1, 2, 1]
    # the second sample starts from the kept message alone, rendered once: no re-tokenised earlier turn
    assert g.prompt_ids[1] == tok(REPLY.format(1), add_special_tokens=False).input_ids
    assert episode_metrics(g.episodes)["episode/splits"] == 1.0
    assert episode_metrics(g.episodes)["episode/turns"] == 3.0
    trainer, drawn = trainer_logprobs(model, tok, g)
    torch.testing.assert_close(trainer, drawn, rtol=0, atol=2e-5)


class Prober(AgentEnvironment):
    """Sends malformed and over-limit requests and keeps what came back (one episode)."""

    seen: dict = {}

    def rollout(self, row, seed, policy):
        url, out = policy.base_url, {}
        with httpx.Client(timeout=30) as http:
            out["not_json"] = http.post(f"{url}/chat/completions", content=b"{oops")
            out["no_messages"] = http.post(f"{url}/chat/completions", json={"model": "m"})
            out["bad_role"] = http.post(f"{url}/chat/completions", json={"messages": [{"role": "robot", "content": ""}]})
            out["n"] = http.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "1"}],
                                                                   "n": 2})
            out["models"] = http.get(f"{url}/models")
            out["elsewhere"] = http.post(url.split("/episodes/")[0] + "/episodes/99/v1/completions",
                                         json={"prompt": "1"})
            out["ids"] = http.post(f"{url}/completions", json={"prompt": [5, 6, 7], "logprobs": 1,
                                                                "return_token_ids": True, "max_tokens": 3})
            first = out["ids"].json()
            prompt = [5, 6, 7] + first["choices"][0]["token_ids"] + [8]  # extends the first call: one sample
            out["more"] = http.post(f"{url}/completions", json={"prompt": prompt, "return_token_ids": True})
            out["stream"] = http.post(f"{url}/chat/completions", json={"messages": [{"role": "user", "content": "1"}],
                                                                        "stream": True})
            out["over"] = http.post(f"{url}/completions", json={"prompt": "1"})  # a 4th call, max_turns 3
        type(self).seen = {k: (r.status_code, r.text) for k, r in out.items()} | {"first": first}
        return 0.0


def test_requests_get_openai_shapes_and_the_episode_limits_hold(tiny):
    import json

    model, tok, sampler = tiny
    g = episodes(Prober).generate(sampler, tok, ROWS[:1], 1, GenerationSettings(max_new_tokens=8), seed=0)
    seen = Prober.seen
    for key, param in (("not_json", None), ("no_messages", "messages"), ("bad_role", "messages[0].role"), ("n", "n")):
        status, text = seen[key]
        error = json.loads(text)["error"]
        assert status == 400 and error["type"] == "invalid_request_error" and error["param"] == param, key
    assert seen["elsewhere"][0] == 404 and json.loads(seen["elsewhere"][1])["error"]["code"] == "not_found"
    assert json.loads(seen["models"][1])["data"][0]["id"] == "policy"
    first = seen["first"]
    assert first["prompt_token_ids"] == [5, 6, 7] and 1 <= len(first["choices"][0]["token_ids"]) <= 3
    assert len(first["choices"][0]["logprobs"]["token_logprobs"]) == len(first["choices"][0]["token_ids"])
    assert seen["stream"][0] == 200 and seen["stream"][1].rstrip().endswith("data: [DONE]")
    over = json.loads(seen["over"][1])["error"]
    assert seen["over"][0] == 400 and over["code"] == "max_turns"
    # the two completions calls merged (the client's id 8 as context, no loss); the chat call started another
    assert len(g) == 2 and g.episodes["ended"] == ["max_turns", "max_turns"]
    drawn = first["choices"][0]["token_ids"]
    assert g.prompt_ids[0] == [5, 6, 7] and g.completion_ids[0][: len(drawn) + 1] == drawn + [8]
    assert g.loss_mask[0][: len(drawn) + 1] == [1] * len(drawn) + [0]


class Hangs(AgentEnvironment):
    """The second episode's harness never answers."""

    async def rollout(self, row, seed, policy):
        if row["prompt"] == "b":
            await asyncio.sleep(600)
        async with policy.client() as client:
            r = await client.chat.completions.create(model="any", messages=[{"role": "user", "content": "1+1="}])
        return float(bool(r.choices[0].message.content is not None))


def test_a_hanging_harness_times_out_and_the_others_go_on(tiny):
    model, tok, sampler = tiny
    rows = [{"prompt": "a"}, {"prompt": "b"}]
    start = time.perf_counter()
    g = episodes(Hangs, timeout_s=3.0).generate(sampler, tok, rows, 1, GenerationSettings(max_new_tokens=8), seed=0)
    assert time.perf_counter() - start < 60
    assert g.episodes["ended"] == ["done", "timeout"]
    assert episode_metrics(g.episodes)["episode/ended_timeout"] == 0.5


class Judged(AgentEnvironment):
    """Calls no model: a won episode with a shaped reward, one ended at its own cap, or a harness that fails."""

    async def rollout(self, row, seed, policy):
        assert self.limits == Limits(max_turns=3, max_tokens=400)  # the stage's, as in-process episodes get them
        if row["prompt"] == "fail":
            raise ValueError("the harness broke")
        if row["prompt"] == "won":
            return {"reward": 0.7, "success": True}
        return Step(reward=0.2, info={"ended": "max_turns"})


def test_a_rollout_says_success_and_its_ending_and_a_batch_of_failures_stops():
    _, tok = policy()
    gen = GenerationSettings(max_new_tokens=8)
    rows = [{"prompt": "won"}, {"prompt": "capped"}, {"prompt": "fail"}]
    g = episodes(Judged).generate(Scripted(tok, []), tok, rows, 1, gen, seed=0)
    assert g.episodes["ended"] == ["done", "max_turns", "error"] and g.episodes["success"] == [True, None, None]
    assert g.episodes["reward"] == [0.7, 0.2, 0.0]
    with pytest.raises(EpisodeError, match=r"^environment 'environment' failed on every episode of a batch of 2; "
                                           r"the first: rollout raised ValueError: the harness broke$"):
        episodes(Judged).generate(Scripted(tok, []), tok, rows[2:], 2, gen, seed=0)


class Scripted(HFSampler):
    """Answers every row with the next of `texts` (and its stop token), log-prob -0.5 a token."""

    def __init__(self, tok, texts):
        super().__init__(HFSampler.Config())
        self.tok, self.texts = tok, list(texts)

    def generate(self, prompt_ids, n, gen, seed):
        from alignflow.core.sampling import Generation

        ids = [self.tok(self.texts.pop(0), add_special_tokens=False).input_ids + [self.tok.eos_token_id]
               for _ in prompt_ids]
        return Generation(list(range(len(ids))), ids, [""] * len(ids), [False] * len(ids), [[-0.5] * len(r) for r in ids])


ADD = {"type": "function", "function": {"name": "add", "description": "a + b",
                                         "parameters": {"type": "object", "properties": {"expr": {"type": "string"}},
                                                        "required": ["expr"]}}}


class ToolUser(AgentEnvironment):
    """Asks with a tool, runs the call the policy made, sends its result back, keeps the answers."""

    seen: list = []

    async def rollout(self, row, seed, policy):
        async with policy.client() as client:
            messages = [{"role": "user", "content": "2+3="}]
            first = await client.chat.completions.create(model="m", messages=messages, tools=[ADD])
            call = first.choices[0].message.tool_calls[0]
            messages += [first.choices[0].message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "5"}]
            second = await client.chat.completions.create(model="m", messages=messages, tools=[ADD])
        type(self).seen = [first, second]
        return 1.0


def test_tool_calls_come_back_in_openai_shape_and_their_results_merge_as_context():
    _, tok = policy()
    sampler = Scripted(tok, ["let me see <call>add 2 3</call>", "<answer>5</answer>"])
    g = episodes(ToolUser).generate(sampler, tok, ROWS[:1], 1, GenerationSettings(max_new_tokens=64), seed=0)
    first, second = ToolUser.seen
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content == "let me see"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("add", '{"expr": "2 3"}')]
    assert second.choices[0].message.content == "<answer>5</answer>" and second.choices[0].finish_reason == "stop"
    assert len(g) == 1 and g.episodes["tool_calls"] == [1] and g.episodes["turns"] == [2]
    eos = [tok.eos_token_id]
    encode = lambda text: tok(text, add_special_tokens=False).input_ids  # noqa: E731
    call, result, answer = encode("let me see <call>add 2 3</call>") + eos, encode("<result>5</result>"), \
        encode("<answer>5</answer>") + eos
    assert g.completion_ids[0] == call + result + answer  # the sampled ids, the tool's result in the tag format
    assert g.loss_mask[0] == [1] * len(call) + [0] * len(result) + [1] * len(answer)
    assert g.logprobs[0] == [-0.5] * len(call) + [0.0] * len(result) + [-0.5] * len(answer)
