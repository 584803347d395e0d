"""Episodes driven through the policy endpoint on vLLM's engine: an agent written against the `openai` SDK gets
the ids, masks and log-probs the same episode gets in-process, and the trainer scores them as vLLM drew them."""

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # vLLM's engine core and the endpoint's server
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

from alignflow.core.environments import Environment, Step  # noqa: E402
from alignflow.core.environments.agents import AgentEnvironment  # noqa: E402
from alignflow.core.environments.episodes import Episodes  # noqa: E402
from alignflow.core.spec.settings import GenerationSettings  # noqa: E402
from alignflow.core.train.models import build_tiny, load_model, load_tokenizer, token_logprobs  # noqa: E402
from alignflow.flows.stages.rl.rollout import Samples, to_batch  # noqa: E402
from alignflow.plugins.vllm_sampler import VLLMSampler  # noqa: E402
from helpers.stopping import stop_early  # noqa: E402

ROWS = [{"prompt": "12+34="}, {"prompt": "5*6="}]


class Echo(Environment):
    def step(self, turn):
        return Step(f"\n[{turn.index}]\n", reward=1.0)


class EchoAgent(AgentEnvironment):
    async def rollout(self, row, seed, policy):
        async with policy.client() as client:
            messages = [{"role": "user", "content": row["prompt"]}]
            for t in range(3):
                r = await client.chat.completions.create(model="any", messages=messages)
                messages += [{"role": "assistant", "content": r.choices[0].message.content},
                             {"role": "user", "content": f"\n[{t}]\n"}]
        return 3.0


def test_vllm_endpoint_episodes_equal_in_process_ones(tmp_path):
    path = build_tiny(tmp_path / "tiny", seed=0)
    model, tok = stop_early(load_model(path)).eval(), load_tokenizer(path)
    sampler = VLLMSampler()
    sampler.load(model, tok)
    greedy = GenerationSettings(max_new_tokens=24, temperature=0.0)
    try:
        inside = Episodes(Echo, None, max_turns=3, max_tokens=200).generate(sampler, tok, ROWS, 2, greedy, seed=1)
        together = EchoAgent.Config(batch_wait_s=30.0)  # every episode's call in each batch
        outside = Episodes(EchoAgent, together, max_turns=3, max_tokens=200).generate(sampler, tok, ROWS, 2, greedy,
                                                                                      seed=1)
        drawn = Episodes(EchoAgent, EchoAgent.Config(), max_turns=3, max_tokens=200).generate(
            sampler, tok, ROWS, 2, GenerationSettings(max_new_tokens=24, temperature=1.0), seed=2)
    finally:
        sampler.close()
    assert outside.prompt_ids == inside.prompt_ids and outside.completion_ids == inside.completion_ids
    assert outside.loss_mask == inside.loss_mask
    torch.testing.assert_close(torch.tensor(sum(outside.logprobs, [])), torch.tensor(sum(inside.logprobs, [])),
                               rtol=0, atol=1e-4)
    samples = Samples(prompt_ids=drawn.prompt_ids, completion_ids=drawn.completion_ids, logprobs=drawn.logprobs,
                      group=drawn.prompt_index, reward=drawn.episodes["reward"], correct=[False] * len(drawn),
                      truncated=drawn.truncated, values={}, loss_mask=drawn.loss_mask)
    batch = to_batch(samples, tok.pad_token_id, 200)
    mask = batch.rollout.response_mask.bool()
    trainer = token_logprobs(model, batch.input_ids, batch.attention_mask, mask.float())
    torch.testing.assert_close(trainer[mask], batch.rollout.sampler_logprobs[mask], atol=1e-4, rtol=0)
    assert drawn.episodes["turns"] == [3] * 4 and drawn.episodes["final"] == [True] * 4
