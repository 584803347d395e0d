"""The `verifiers` environment: verifiers 0.4 environments, built here from its own classes (a taskset, a task with
rewards and a metric, a harness whose chat loop runs in-process, as its contract allows), run through the policy
endpoint. The rubric's reward is the episode's reward, a multi-turn episode is one sample with verifiers' user
turns masked, the trainer scores the ids the endpoint drew, and a failing episode ends alone as an error."""

import hashlib
from importlib.metadata import version
from pathlib import Path

import pytest
import torch

pytest.importorskip("verifiers")
vf = pytest.importorskip("verifiers.v1")

from openai import AsyncOpenAI  # noqa: E402
from verifiers.v1.dialects.chat import message_to_wire  # noqa: E402

from alignflow.core import AlignflowError  # noqa: E402
from alignflow.core.environments.episodes import Episodes, episode_metrics  # noqa: E402
from alignflow.core.plugins import get_plugins  # noqa: E402
from alignflow.core.spec.schema import parse_spec, resolved_stages  # noqa: E402
from alignflow.core.spec.settings import GenerationSettings  # noqa: E402
from alignflow.core.task.tokenizer import build_char_tokenizer  # noqa: E402
from alignflow.core.train.models import token_logprobs  # noqa: E402
from alignflow.flows.digest import plugin_versions, stage_config  # noqa: E402
from alignflow.flows.stages.rl.rollout import Samples, to_batch  # noqa: E402
from alignflow.plugins import verifiers_env  # noqa: E402
from alignflow.plugins.hf import HFSampler  # noqa: E402
from alignflow.plugins.verifiers_env import VerifiersEnv  # noqa: E402

pytestmark = pytest.mark.system  # each generate starts the policy endpoint and verifiers' interception server
__all__ = ["SumsTaskset", "ChatHarness"]  # what verifiers' loaders find here: this module is the taskset's id
ID = __name__
ROWS = [{"question": "12+34=", "answer": "46"}, {"question": "5*6=", "answer": "30"}]
REPLY = "\nturn {} seen, go on:\n"


class SumsData(vf.TaskData):
    answer: str = ""


class SumsTask(vf.Task[SumsData]):
    """Rewards computed from the last reply's text: 0.1 per character, 1 per digit; a metric on the answer."""

    @vf.reward(weight=0.1)
    async def length(self, trace) -> float:
        return float(len(trace.last_reply))

    @vf.reward(weight=1.0)
    async def digits(self, trace) -> float:
        if self.data.answer == "raise":
            raise ValueError("this task's rubric fails")
        return float(sum(c.isdigit() for c in trace.last_reply))

    @vf.metric
    async def answered(self, trace) -> float:
        return float(self.data.answer in trace.last_reply)


class SumsTaskset(vf.Taskset[SumsTask, vf.TasksetConfig]):
    def load(self):
        return [SumsTask(SumsData(prompt=r["question"], answer=r["answer"])) for r in ROWS]


class ChatHarness(vf.Harness[vf.HarnessConfig]):
    """One chat call per segment, in-process, through verifiers' interception endpoint (no program to install)."""

    APPENDS_SYSTEM_PROMPT = True
    SUPPORTS_RESUME = True  # a later segment is relaunched on the whole conversation
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else \
            [message_to_wire(m) for m in prompt]
        async with AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(0, "", "")


class Replies(vf.Env[vf.SingleAgentEnvConfig]):
    """Multi-turn: verifiers' env plays the user, answering the model's first two turns with a line of text."""

    async def run(self, task, agents):
        async with agents.agent.interaction(task) as chat:
            await chat.turn()
            for t in range(2):
                await chat.turn(REPLY.format(t))


AGENT = {"harness": {"id": ID}, "runtime": {"type": "subprocess"}}  # verifiers' default runtime is a Prime sandbox


def single_turn():
    return vf.SingleAgentEnv(vf.SingleAgentEnvConfig(taskset={"id": ID}, agent=AGENT))


def multi_turn():
    return Replies(vf.SingleAgentEnvConfig(taskset={"id": ID}, agent=AGENT))


class Recording(VerifiersEnv):
    """Keeps what each rollout returned (the runner keeps only the reward), by question."""

    results: dict = {}

    async def rollout(self, row, seed, policy):
        out = await super().rollout(row, seed, policy)
        type(self).results.setdefault(row["question"], []).append(out)
        return out


@pytest.fixture(scope="module")
def tiny():
    """A random tiny Qwen2 whose turns end after ~6 tokens; verifiers' subprocess runtime folders in a temp dir."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

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
    sampler = HFSampler(HFSampler.Config())
    sampler.load(model, tok)
    return model, tok, sampler


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """verifiers' subprocess runtime makes a folder per rollout under ~/.cache/verifiers: here, a temp dir."""
    import verifiers.v1.runtimes.subprocess as runtimes

    monkeypatch.setattr(runtimes, "CACHE_DIR", tmp_path)


def episodes(env=VerifiersEnv, **config):
    return Episodes(env, env.Config(**config), max_turns=3, max_tokens=400)


def trainer_logprobs(model, tok, g):
    samples = Samples(prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, logprobs=g.logprobs,
                      group=g.prompt_index, reward=g.episodes["reward"], correct=[False] * len(g),
                      truncated=g.truncated, values={}, loss_mask=g.loss_mask)
    batch = to_batch(samples, tok.pad_token_id, 400)
    mask = batch.rollout.response_mask.bool()
    return token_logprobs(model, batch.input_ids, batch.attention_mask, mask.float())[mask], \
        batch.rollout.sampler_logprobs[mask]


def test_the_rubric_scores_the_reply_the_endpoint_sampled(tiny):
    model, tok, sampler = tiny
    Recording.results = {}
    # loaded by id, as an installed environment is: verifiers' loader finds this module's taskset and harness
    g = episodes(Recording, id=ID, args={"agent": AGENT}).generate(sampler, tok, ROWS, 2,
                                                                   GenerationSettings(max_new_tokens=16), seed=4)
    assert len(g) == 4 and g.prompt_index == [0, 0, 1, 1] and g.episodes["ended"] == ["done"] * 4
    assert g.episodes["turns"] == [1] * 4 and all(m == [1] * len(m) for m in g.loss_mask)
    for k, text in enumerate(g.texts):  # what the endpoint returned, as verifiers' trace strips it
        reply = text.strip()
        assert g.episodes["reward"][k] == pytest.approx(0.1 * len(reply) + sum(c.isdigit() for c in reply))
    # the task's prompt is the row's `question` (it has no `prompt` column), the one message of the context
    assert g.prompt_ids[0] == tok("12+34=", add_special_tokens=False).input_ids
    # each reward and the metric, in the rollout's info (the two episodes of a row finish in either order)
    for k, row in enumerate(ROWS):
        replies = [t.strip() for t in g.texts[2 * k: 2 * k + 2]]
        assert sorted((o["reward/length"], o["reward/digits"], o["answered"], o["turns"])
                      for o in Recording.results[row["question"]]) == \
            sorted((len(r), sum(c.isdigit() for c in r), float(row["answer"] in r), 1.0) for r in replies)


def test_a_multi_turn_episode_is_one_sample_that_trains_on_the_drawn_ids(tiny):
    model, tok, sampler = tiny
    gen = GenerationSettings(max_new_tokens=16)
    g = episodes(loader=f"{ID}:multi_turn").generate(sampler, tok, ROWS, 2, gen, seed=5)
    assert len(g) == 4 and g.episodes["final"] == [True] * 4 and g.episodes["sample"] == [0] * 4
    assert g.episodes["turns"] == [3] * 4 and episode_metrics(g.episodes)["episode/splits"] == 0.0
    # the env's two user turns are context (mask 0), rendered as the template renders a user message
    for ids, mask in zip(g.completion_ids, g.loss_mask):
        assert tok.decode([t for t, m in zip(ids, mask) if not m]) == REPLY.format(0) + REPLY.format(1)
    trainer, drawn = trainer_logprobs(model, tok, g)
    torch.testing.assert_close(trainer, drawn, rtol=0, atol=2e-5)
    # the reward scores the last turn: the text after the last user turn
    for k, ids in enumerate(g.completion_ids):
        last = tok.decode(ids, skip_special_tokens=True).split(REPLY.format(1))[-1].strip()
        assert g.episodes["reward"][k] == pytest.approx(0.1 * len(last) + sum(c.isdigit() for c in last))


def test_an_episode_whose_rubric_raises_ends_as_an_error_and_the_others_finish(tiny, caplog):
    model, tok, sampler = tiny
    rows = [ROWS[0], {"question": "7-2=", "answer": "raise"}]
    gen = GenerationSettings(max_new_tokens=16)
    g = episodes(loader=f"{ID}:single_turn").generate(sampler, tok, rows, 1, gen, seed=0)
    assert g.episodes["ended"] == ["done", "error"]
    assert g.episodes["reward"][1] == 0.0 and g.episodes["reward"][0] > 0.0
    assert "the episode failed" in caplog.text and "this task's rubric fails" in caplog.text  # verifiers' error


def test_the_environment_loads_once_per_process_and_a_row_must_fit_its_task_data():
    verifiers_env._LOADED.clear()
    a = VerifiersEnv.Config(loader=f"{ID}:single_turn")
    env = verifiers_env.environment(a)
    assert verifiers_env.environment(VerifiersEnv.Config(loader=f"{ID}:single_turn", columns={"prompt": "q"})) is env
    assert verifiers_env.environment(VerifiersEnv.Config(loader=f"{ID}:multi_turn")) is not env
    by_id = verifiers_env.environment(VerifiersEnv.Config(id=ID, args={"agent": AGENT, "timeout": {"episode": 60}}))
    assert type(by_id) is vf.SingleAgentEnv and type(by_id.taskset) is SumsTaskset
    assert by_id.config.agent.harness.id == ID and by_id.config.timeout.episode == 60  # `args` reach verifiers
    task = verifiers_env.task_of(env, {"q": "1+1=", "info": {"answer": "2", "other": 0}}, {"prompt": "q"})
    assert type(task) is SumsTask and task.data.prompt == "1+1=" and task.data.answer == "2"
    with pytest.raises(AlignflowError, match="does not have"):
        verifiers_env.task_of(env, ROWS[0], {"reference": "answer"})
    with pytest.raises(AlignflowError, match="row '7' does not make a SumsData"):
        verifiers_env.task_of(env, {"question": "7", "answer": 7}, {})
    with pytest.raises(AlignflowError, match=r"row '1\+1=' has no column \['problem'\]"):
        verifiers_env.task_of(env, {"prompt": "1+1="}, {"prompt": "problem"})
    with pytest.raises(ValueError, match="exactly one of"):
        VerifiersEnv.Config(id="gsm8k", loader=f"{ID}:single_turn")
    with pytest.raises(ValueError, match=r"sets \['stop', 'n'\], which the policy endpoint refuses"):
        VerifiersEnv.Config(id="gsm8k", sampling={"stop": ["\n"], "n": 4, "max_tokens": 64})


def test_its_config_the_loader_s_source_and_the_packages_it_names_enter_the_digest():
    raw = {"name": "vf", "stages": {"rl": {
        "kind": "rl", "inputs": {"model": "builtin:tiny", "dataset": "rl.jsonl"}, "algorithm": "grpo",
        "environment": {"name": "verifiers", "config": {"loader": f"{ID}:multi_turn", "columns": {"prompt": "q"}}}}}}
    spec, plugins = parse_spec(raw, "vf.yaml", get_plugins()), get_plugins()
    config = stage_config(spec.stages["rl"], resolved_stages(spec, plugins)["rl"])["environment"]["config"]
    assert config["loader"] == f"{ID}:multi_turn" and config["columns"] == {"prompt": "q"}
    assert config["sources"] == {__file__: hashlib.sha256(Path(__file__).read_bytes()).hexdigest()}
    versions = plugin_versions(spec.stages["rl"], plugins)["environment/verifiers"]
    assert versions["libraries"] == {"verifiers": version("verifiers")}
    # an installed environment's package by its id (hub ids `owner/name@version` install as `name`; loguru, which
    # verifiers needs, stands in for one); verifiers' own tasksets and harnesses go with its version
    named = VerifiersEnv.Config(id="someone/loguru@0.7", args={"agent": {"harness": {"id": "null"}}})
    assert named.packages == {"loguru": version("loguru")}
    assert VerifiersEnv.Config(id="textarena").packages == {}
