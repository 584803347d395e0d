"""On a real model and sampler, a 3-turn episode's model tokens score the same under the trainer's forward as
the sampler drew them, and the environment's tokens carry no loss."""

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from alignflow.core.environments import Environment, Step
from alignflow.core.environments.episodes import Episodes
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.core.train.models import token_logprobs
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.plugins.hf import HFSampler


class Echo(Environment):
    """Answers every turn with a line of text; ends only at max_turns."""

    def reset(self, row, seed):
        return row["prompt"]

    def step(self, turn):
        return Step(f"\nturn {turn.index} seen, go on:\n", reward=0.5)


def policy():
    torch.manual_seed(0)
    tok = build_char_tokenizer(512)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    return Qwen2ForCausalLM(cfg).eval(), tok


def test_three_turns_trainer_logprobs_equal_the_samplers():
    model, tok = policy()
    # a random policy rarely stops by itself: a bias on the stop token's logit ends turns after ~6 tokens
    head = torch.nn.Linear(32, len(tok), bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.eos_token_id] = 4.0
    model.lm_head = head
    sampler = HFSampler(HFSampler.Config())
    sampler.load(model, tok)
    gen = GenerationSettings(max_new_tokens=24, temperature=1.0)
    rows = [{"prompt": "12+34="}, {"prompt": "5*6="}]
    g = Episodes(Echo, None, max_turns=3, max_tokens=400).generate(sampler, tok, rows, 2, gen, seed=3)
    samples = Samples(prompt_ids=g.prompt_ids, completion_ids=g.completion_ids, logprobs=g.logprobs,
                      group=g.prompt_index, reward=g.episodes["reward"], correct=[False] * len(g),
                      truncated=g.truncated, values={}, loss_mask=g.loss_mask)
    batch = to_batch(samples, tok.pad_token_id, 400)
    mask = batch.rollout.response_mask
    trainer = token_logprobs(model, batch.input_ids, batch.attention_mask, mask, temperature=1.0)
    # episodes that reached three turns carry two environment replies between model turns
    three = [i for i, t in enumerate(g.episodes["turns"]) if t == 3]
    assert three, g.episodes
    for i in range(len(g)):
        model_tokens = mask[i].bool()
        assert int(model_tokens.sum()) == sum(g.loss_mask[i])
        torch.testing.assert_close(trainer[i][model_tokens], batch.rollout.sampler_logprobs[i][model_tokens],
                                   rtol=0, atol=2e-5)
    # the replies sit inside the response span with mask 0: context for the next turn, no loss
    i = three[0]
    reply = [t for t, m in zip(g.completion_ids[i], g.loss_mask[i]) if not m]
    assert tok.decode(reply) == "\nturn 0 seen, go on:\n\nturn 1 seen, go on:\n"
    assert g.episodes["reward"][i] == 1.5  # 0.5 for each of the 3 turns
