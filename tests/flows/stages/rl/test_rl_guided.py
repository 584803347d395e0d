"""Guided samples in the rl stage (ExPO's self-explanations) on the tiny model: drawn only for groups with no
correct completion, after the hinted prompt, and scored (pi_old, the update) after the plain prompt."""

import json
import math
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from alignflow.core import hookimpl
from alignflow.core.train.models import load_model, load_tokenizer, token_logprobs
from alignflow.core.plugins import get_plugins
from alignflow.core.rewards import Reward, RewardSet
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.guided import rescore_guided, with_guided
from alignflow.flows.stages.rl.rollout import collect, to_batch
from alignflow.plugins.expo import ExPO, ExPOConfig
from alignflow.plugins.hf import HFSampler

ANSWERS = ["easy", "hard", "easy", "hard"]
HINT = "<answer>{answer}</answer>{prompt}"  # ExPO's default hint


def easy_or_hinted(prompts, completions, answer, **columns):
    """1 for an "easy" row, or a completion of a hinted prompt; so "hard" groups are unsolved unless hinted."""
    return [float(a == "easy" or p.startswith("<answer>")) for p, a in zip(prompts, answer)]


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def rows():
    return [{"prompt": f"{i}+{i}=", "answer": a} for i, a in enumerate(ANSWERS)]


def never_hinted(prompts, completions, answer, **columns):
    """1 for an "easy" row only: no self-explanation is ever accepted."""
    return [float(a == "easy") for a in answer]


def collect_step(tiny, reward, dataset):
    """Step 0's samples of 4 prompts x 3 with 2 guided samples per unsolved group, the tokenizer and model."""
    tok, model = load_tokenizer(tiny), load_model(tiny)
    sampler = HFSampler()
    sampler.load(model, tok)
    settings = RLSettings(max_steps=1, prompts_per_step=4, group_size=3, micro_batch_size=4,
                          generation={"max_new_tokens": 5, "temperature": 0.8})
    rewards = RewardSet([Reward(reward.__name__, 1.0, reward)])
    ctx, algo = SimpleNamespace(settings=settings, seed=0), ExPO(ExPOConfig(guided_samples=2))
    p = SimpleNamespace(algo=algo, sampler=sampler, tokenizer=tok, rewards=rewards, dataset=dataset,
                        process_reward=None, prompts=None, episodes=None)  # the stage's Parts that collect reads
    kept, drawn, metrics, sources = collect(ctx, p, 0)
    kept, guided = with_guided(ctx, p, 0, kept, sources)
    return kept, drawn, {**metrics, **guided}, tok, model


def test_a_step_where_no_self_explanation_is_accepted_adds_no_row(tiny, one_thread):
    # The r1-tiny run hit this on its first step: unsolved groups, hints generated, none correct.
    kept, _, metrics, _, _ = collect_step(tiny, never_hinted, rows())
    assert kept.guided is None and len(kept) == 12
    assert (metrics["guided/groups"], metrics["guided/rows"], metrics["guided/accept_rate"]) == (2.0, 0.0, 0.0)


def test_guided_rows_only_for_unsolved_groups_after_the_plain_prompt(tiny, one_thread):
    dataset = rows()
    kept, drawn, metrics, tok, model = collect_step(tiny, easy_or_hinted, dataset)
    assert drawn.guided is None and len(drawn) == 12  # the sampled rounds: 4 prompts x 3, none guided
    assert kept.guided == [False] * 12 + [True] * 4
    prompt_of = {g: tok.decode(p) for g, p in zip(kept.group[:12], kept.prompt_ids[:12])}
    hard = {g for g, p in prompt_of.items() if p in ("1+1=", "3+3=")}
    guided = [i for i, flag in enumerate(kept.guided) if flag]
    # two accepted self-explanations for each "hard" group (all of its 3 samples wrong), none for "easy" ones
    assert sorted(kept.group[i] for i in guided) == sorted(list(hard) * 2)
    assert all(kept.correct[i] and kept.reward[i] == 1.0 for i in guided)
    assert (metrics["guided/groups"], metrics["guided/rows"], metrics["guided/accept_rate"]) == (2.0, 4.0, 1.0)
    # their prompt is the plain one: every forward of the stage scores them after it
    assert all(kept.prompt_ids[i] == tok([prompt_of[kept.group[i]]]).input_ids[0] for i in guided)

    batch = to_batch(kept, tok.pad_token_id, 5)
    assert batch.rollout.guided.tolist() == kept.guided

    def forward(ids, attention, mask):
        return token_logprobs(model, ids, attention, mask, temperature=0.8)

    with torch.no_grad():
        rescored = rescore_guided(batch, 4, forward).rollout
    r = batch.rollout
    for i in guided:
        plain = prompt_of[kept.group[i]]
        completion = kept.completion_ids[i]
        hinted = tok([HINT.format(prompt=plain, answer=dataset[int(plain[0])]["answer"])]).input_ids[0]
        n = len(tok([plain]).input_ids[0])
        with torch.no_grad():
            after_plain = token_logprobs(model, torch.tensor([tok([plain]).input_ids[0] + completion]),
                                         torch.ones(1, n + len(completion)), temperature=0.8)[0, n:]
            after_hint = token_logprobs(model, torch.tensor([hinted + completion]),
                                       torch.ones(1, len(hinted) + len(completion)), temperature=0.8)[0, len(hinted):]
        here = r.response_mask[i].bool()
        # the sampler's log-probs were after the hint; rescoring puts pi_old (and mu) after the plain prompt
        torch.testing.assert_close(r.old_logprobs[i, here], after_hint, atol=1e-4, rtol=0)
        torch.testing.assert_close(rescored.old_logprobs[i, here], after_plain, atol=1e-4, rtol=0)
        torch.testing.assert_close(rescored.sampler_logprobs[i, here], after_plain, atol=1e-4, rtol=0)
        assert (after_plain - after_hint).abs().max() > 1e-2  # so the test tells the two apart
    ordinary = ~r.guided
    assert torch.equal(rescored.old_logprobs[ordinary], r.old_logprobs[ordinary])
    # pi_old already recomputed on every row (recompute_old_logprobs): no second forward, mu set to it
    recomputed = replace(batch, rollout=replace(r, old_logprobs=rescored.old_logprobs))
    again = rescore_guided(recomputed, 4).rollout
    assert torch.equal(again.old_logprobs, rescored.old_logprobs)
    assert torch.equal(again.sampler_logprobs[r.guided], rescored.old_logprobs[r.guided])


class Spy(ExPO):
    """ExPO that records, on each micro-batch, how far pi_old is from the trainer's log-probs."""

    seen: list = []

    def loss(self, batch):
        gap = ((batch.old_logprobs - batch.logprobs.detach()).abs() * batch.response_mask).amax(-1)
        Spy.seen.append((gap[batch.guided].max().item() if batch.guided.any() else 0.0,
                         gap[~batch.guided].max().item() if not batch.guided.all() else 0.0,
                         int(batch.guided.sum())))
        return super().loss(batch)


class TestPlugins:
    @staticmethod
    @hookimpl
    def register_algorithms(register):
        register("expo_spy", Spy)

    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("easy_or_hinted", easy_or_hinted)


def test_expo_trains_through_the_stage_with_pi_old_after_the_plain_prompt(tmp_path, tiny, one_thread):
    plugins = get_plugins()
    plugins.add(TestPlugins, "test_rl_guided")
    try:
        data = tmp_path / "rl.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows()))
        spec = StageSpec(kind="rl", inputs={"model": str(tiny), "dataset": str(data)},
                         algorithm={"name": "expo_spy", "config": {"guided_samples": 2}}, rewards=["easy_or_hinted"],
                         sampler="hf")
        settings = RLSettings(max_steps=1, prompts_per_step=4, group_size=3, micro_batch_size=4, lr=1e-3,
                              generation={"max_new_tokens": 5}, save_every=1)
        (tmp_path / "work").mkdir()
        log = []
        ctx = StageContext("rl", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                           tmp_path / "checkpoints", 0, lambda m, step: log.append((step, m)), plugins)
        Spy.seen = []
        result = run_rl(ctx)
    finally:
        plugins.remove("test_rl_guided")
    metrics = log[0][1]
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["guided/rows"] == 4.0 and metrics["expo/sft_nll"] > 0
    assert metrics["accuracy"] == 0.5  # of the sampled rows only: the guided ones are not counted
    # one optimizer step, after every micro-batch: pi_old is the trainer's own forward on every row, the guided
    # ones included (the sampler's log-probs after the hint would be far from it)
    assert sum(n for *_, n in Spy.seen) == 4
    assert max(g for g, *_ in Spy.seen) < 1e-4
    assert max(o for _, o, _ in Spy.seen) < 1e-4
    before, after = load_model(tiny).state_dict(), load_model(result.outputs["model"]).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
