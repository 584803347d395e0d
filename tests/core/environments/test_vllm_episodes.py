"""Episodes on vLLM's engine: a multi-turn transcript's model tokens carry vLLM's log-probs, which are the
trainer's; the environment's replies sit between them with no loss."""

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.system]  # vLLM starts its engine core in a process of its own
pytest.importorskip("vllm", reason="vLLM is not installed: .ci/run runs these tests in an environment that has it")

from alignflow.core.environments import Environment, Step  # noqa: E402
from alignflow.core.environments.episodes import Episodes  # noqa: E402
from alignflow.core.spec.settings import GenerationSettings  # noqa: E402
from alignflow.core.train.models import build_tiny, load_model, load_tokenizer, token_logprobs  # noqa: E402
from alignflow.flows.stages.rl.rollout import Samples, to_batch  # noqa: E402
from alignflow.plugins.vllm_sampler import VLLMSampler  # noqa: E402
from helpers.stopping import stop_early  # noqa: E402


class Echo(Environment):
    def step(self, turn):
        return Step(f"\n[{turn.index}]\n", reward=1.0)


def test_vllm_episodes_are_token_in_token_out(tmp_path):
    path = build_tiny(tmp_path / "tiny", seed=0)
    model, tok = stop_early(load_model(path)).eval(), load_tokenizer(path)
    sampler = VLLMSampler()
    sampler.load(model, tok)
    try:
        g = Episodes(Echo, None, max_turns=3, max_tokens=200).generate(
            sampler, tok, [{"prompt": "12+34="}, {"prompt": "5*6="}], 3, GenerationSettings(max_new_tokens=24,
                                                                                           temperature=1.0), seed=1)
    finally:
        sampler.close()
    assert max(g.episodes["turns"]) == 3, g.episodes
    samples = Samples(prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, logprobs=g.logprobs,
                      group=g.prompt_index, reward=g.episodes["reward"], correct=[False] * len(g),
                      truncated=g.truncated, values={}, loss_mask=g.loss_mask)
    batch = to_batch(samples, tok.pad_token_id, 200)
    mask = batch.rollout.response_mask.bool()
    trainer = token_logprobs(model, batch.input_ids, batch.attention_mask, mask.float())
    torch.testing.assert_close(trainer[mask], batch.rollout.sampler_logprobs[mask], atol=1e-4, rtol=0)
    i = g.episodes["turns"].index(3)
    assert tok.decode([t for t, m in zip(g.completion_ids[i], g.loss_mask[i]) if not m]) == "\n[0]\n\n[1]\n"
