"""The rl stage on the tiny model: every registered RL algorithm through one loop, learning, resume, DAPO refills."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from alignflow.core import SpecError, hookimpl
from alignflow.core.train.steps import token_ends
from alignflow.core.train.models import build_tiny, load_model, load_tokenizer, token_logprobs
from alignflow.core.plugins import get_plugins
from alignflow.core.rl.algorithm import Rollout
from alignflow.core.rl.capabilities import EpisodeTurns, has
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.stage import resolve_stage
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl.stage import run_rl
from alignflow.flows.stages.rl.rollout import Samples, to_batch
from alignflow.flows.stages.rl.update import minibatches
from helpers.plugins import registered

ASCII = 128  # the tiny tokenizer's ids below 128 are ASCII bytes: about half its vocabulary


def ascii_first(prompts, completions, completion_ids, answer, **columns):
    """1 when the completion starts with an ASCII byte; always 0 for rows whose answer is "dead"."""
    return [0.0 if a == "dead" else float(ids[0] < ASCII) for ids, a in zip(completion_ids, answer)]


def odd_prompt(prompts, completions, **columns):
    """1 for the prompts "1+1=", "3+3=", ...: a reward that differs between prompts whatever is generated."""
    return [float(int(p.split("+")[0]) % 2) for p in prompts]


class TestRewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("ascii_first", ascii_first)
        register("odd_prompt", odd_prompt)


@pytest.fixture(scope="module")
def plugins():
    with registered(TestRewards, "test_rl_stage") as p:
        yield p


@pytest.fixture(scope="module")
def tiny(tiny_model):
    return tiny_model()


def write_rows(path, answers):
    path.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def make_ctx(tmp_path, plugins, model, algorithm, dataset, log, rewards=("ascii_first",), sampler="hf",
             environment=None, **settings):
    base = dict(max_steps=2, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-3,
                generation={"max_new_tokens": 4}, save_every=1)
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(dataset)}, algorithm=algorithm,
                     rewards=list(rewards), sampler=sampler, environment=environment)
    (tmp_path / "work").mkdir(parents=True, exist_ok=True)
    return StageContext("rl", spec, RLSettings(**{**base, **settings}), {"model": model, "dataset": dataset},
                        tmp_path / "work", tmp_path / "checkpoints", 0, lambda m, step: log.append((step, m)),
                        plugins)


def weights(path):
    return {k: v.clone() for k, v in load_model(path).state_dict().items()}


RL_ALGORITHMS = sorted(e.name for e in get_plugins().algorithms if getattr(e.obj, "stage", None) == "rl")
KEYS = {"accuracy", "reward/total/mean", "reward/total/std", "reward/ascii_first/mean", "reward/ascii_first/std",
        "actor/entropy", "actor/grad_norm", "actor/lr", "response_length/mean", "response_length/max",
        "response_length/truncated", "advantages/mean", "advantages/std", "sampling/groups_filtered",
        "sampling/rounds", "perf/tokens_per_s", "time/generate", "time/score", "time/prepare", "time/train"}


# config fields without a default, and the rewards they name (a cost reward is listed with weight 0)
REQUIRED = {"repo": ({"cost_reward": "odd_prompt"}, [{"name": "odd_prompt", "weight": 0}])}


@pytest.mark.parametrize("name", RL_ALGORITHMS)
def test_every_rl_algorithm_trains_through_the_stage(tmp_path, plugins, tiny, name):
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    config, cost = REQUIRED.get(name, ({}, []))
    cls = plugins.algorithms.get(name)
    algo, spec = cls(cls.Config(**config)), {"name": name, "config": config}
    if algo.requires_step_rewards:  # a process reward scores the steps; long enough to have some
        ctx = make_ctx(tmp_path, plugins, tiny, spec, data, log, ("ascii_first", *cost),
                       generation={"max_new_tokens": 24})
        with_prm(ctx, tiny, tmp_path)
    elif has(algo, EpisodeTurns):  # it learns from the turns of episodes, which need an environment
        ctx = make_ctx(tmp_path, plugins, tiny, spec, data, log, ("ascii_first", *cost),
                       environment={"name": "math_tools", "max_turns": 2, "max_tokens": 12})
    else:
        ctx = make_ctx(tmp_path, plugins, tiny, spec, data, log, ("ascii_first", *cost))
    if algo.requires_teacher:  # another model, so that the distillation advantages are not ~0
        ctx.inputs["teacher"] = build_tiny(tmp_path / "teacher", seed=1)
    result = run_rl(ctx)
    assert [step for step, _ in log[:-1]] == [1, 2] and result.metrics["steps"] == 2
    for _, metrics in log[:-1]:
        assert KEYS <= set(metrics), sorted(KEYS - set(metrics))
        assert all(math.isfinite(v) for v in metrics.values())
        assert ("actor/kl_ref_k3" in metrics) == algo.requires_reference
        assert metrics["sampling/rounds"] >= 1 and metrics["sampling/groups_kept"] <= 2
    assert (ctx.checkpoint_dir / "critic").is_dir() == algo.requires_critic
    before, after = weights(tiny), weights(result.outputs["model"])
    assert before.keys() == after.keys()  # no algorithm parameter leaks into the checkpoint
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_zero3_policy_reference_and_critic_follow_zero0(tmp_path, plugins, tiny):
    """ZeRO-3 shards the policy, the frozen reference (a DeepSpeed engine too) and the critic, and the
    sampler generates through the sharded policy: two PPO steps land where ZeRO-0's do. SGD, so weights
    move by exactly lr x the gradient; step 2's advantages use the critic step 1 trained (2 micro-batches)."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    runs = {}
    for zero in (0, 3):
        log = []
        ctx = make_ctx(tmp_path / f"zero{zero}", plugins, tiny, "ppo", data, log, zero_stage=zero, optimizer="sgd",
                       lr=0.1, grad_clip=0.0)
        runs[zero] = (weights(run_rl(ctx).outputs["model"]), log[1][1])
    (w0, m0), (w3, m3) = runs[0], runs[3]
    for key in ("reward/total/mean", "response_length/mean", "critic/values_mean", "advantages/std"):
        assert m3[key] == pytest.approx(m0[key], rel=1e-4, abs=1e-6), key
    for k in w0:
        torch.testing.assert_close(w3[k], w0[k], rtol=1e-4, atol=1e-6)


def test_an_algorithm_with_its_own_parameters_refuses_zero3(tmp_path, plugins, tiny):
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "lambda_grpo", data, [], zero_stage=3)
    with pytest.raises(SpecError, match="zero_stage: lambda_grpo trains its own parameters.*0, 1 or 2"):
        run_rl(ctx)


def test_a_reward_model_input_reaches_a_reward_config(tmp_path, plugins, tiny):
    # InstructGPT's PPO scores with a reward model another stage trained: `${inputs.NAME}` is its path.
    from alignflow.core.train.models import load_value_model

    prm = load_value_model(tiny)
    prm.config.step_separator = " "  # as the prm stage saves it
    prm.save_pretrained(tmp_path / "prm")
    load_tokenizer(tiny).save_pretrained(tmp_path / "prm")
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, log, max_steps=1)
    ctx.spec.rewards = StageSpec(kind="rl", rewards=[
        "ascii_first", {"name": "prm", "weight": 0.0, "config": {"path": "${inputs.prm}"}}]).rewards
    ctx.resolved = resolve_stage(ctx.spec, ctx.plugins, settings=ctx.settings)  # the rewards just set
    ctx.inputs["prm"] = tmp_path / "prm"
    run_rl(ctx)
    # a fresh head scores 0, so every step is 0.5 likely to be right, and so is the worst one
    assert log[0][1]["reward/prm/mean"] == pytest.approx(0.5)


def test_step_ends_map_to_the_tokens_that_complete_them():
    pieces = ["<th", "ink>", "1+", "2=3", " ", "4", "+5=9"]  # tokens of several characters
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    text = decode(range(len(pieces)))
    assert text == "<think>1+2=3 4+5=9"
    # the steps "<think>1+2=3" and "4+5=9" end after characters 12 and 18: in tokens 3 and 6
    assert token_ends(decode, list(range(len(pieces))), [12, 18]) == [3, 6]
    assert token_ends(decode, list(range(len(pieces))), [1, 13]) == [0, 4]


def test_step_rewards_sit_at_their_tokens_in_the_batch():
    samples = Samples([[1, 2], [3]], [[5, 6, 7], [8, 9]], None, [0, 0], [0.0, 1.0], [False, True],
                      [False, False], {}, steps=[[(0, 0.25), (2, 0.75)], [(1, 0.5)]])
    r = to_batch(samples, 0, 4).rollout
    assert r.step_mask.tolist() == [[0, 0, 1, 0, 1], [0, 0, 1, 0, 0]]  # after 2 and 1 prompt tokens
    assert r.step_rewards[0, 2].item() == 0.25 and r.step_rewards[0, 4].item() == 0.75
    assert r.step_rewards[1, 2].item() == 0.5 and r.step_rewards.sum().item() == 1.5


def prm_checkpoint(tiny, path):
    """The tiny model with a random value head: step scores that differ from step to step."""
    from alignflow.core.train.models import load_value_model

    prm = load_value_model(tiny)
    torch.nn.init.normal_(prm.score.weight, std=0.5, generator=torch.Generator().manual_seed(0))
    prm.config.step_separator = "a"  # a character the random tiny model writes now and then
    prm.save_pretrained(path)
    load_tokenizer(tiny).save_pretrained(path)
    return path


def with_prm(ctx, tiny, tmp_path, outcome="ascii_first"):
    """Add a `prm` reward (weight 0) reading the stage's `prm` input, a random-headed tiny PRM."""
    ctx.spec.rewards = StageSpec(kind="rl", rewards=[
        outcome, {"name": "prm", "weight": 0.0, "config": {"path": "${inputs.prm}"}}]).rewards
    ctx.resolved = resolve_stage(ctx.spec, ctx.plugins, settings=ctx.settings)  # the rewards just set
    ctx.inputs["prm"] = prm_checkpoint(tiny, tmp_path / "prm")


def test_process_supervised_grpo_trains_on_prm_step_rewards(tmp_path, plugins, tiny):
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["dead"] * 4)  # the outcome reward is 0 for every sample
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo_process", data, log, max_steps=1,
                   generation={"max_new_tokens": 24})
    with_prm(ctx, tiny, tmp_path)
    result = run_rl(ctx)
    metrics = log[0][1]
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["reward/total/std"] == 0  # so any spread of the advantages comes from the steps
    assert metrics["advantages/std"] > 0
    before, after = weights(tiny), weights(result.outputs["model"])
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_step_by_step_ppo_learns_from_the_step_rewards(tmp_path, plugins, tiny):
    """The outcome reward is 0 for every sample and the KL weight is PPO's: ppo_process differs from
    ppo only by the PRM's step rewards, so the updates differ, while ppo run twice is the same."""
    data = write_rows(tmp_path / "rl.jsonl", ["dead"] * 4)
    out = []
    for i, name in enumerate(["ppo", "ppo", "ppo_process"]):
        ctx = make_ctx(tmp_path / str(i), plugins, tiny, {"name": name, "config": {"kl_coef": 0.05}}, data, [],
                       max_steps=1, generation={"max_new_tokens": 24})
        with_prm(ctx, tiny, tmp_path / str(i))
        out.append(weights(run_rl(ctx).outputs["model"]))
    assert all(torch.equal(out[0][k], out[1][k]) for k in out[0])
    assert any(not torch.equal(out[0][k], out[2][k]) for k in out[0])


def test_process_supervised_grpo_needs_a_reward_that_scores_steps(tmp_path, plugins, tiny):
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo_process", data, [])
    with pytest.raises(SpecError, match="needs exactly one reward that scores steps.*found 0 \\(ascii_first\\)"):
        run_rl(ctx)


EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "alignflow-plugin-example"


@pytest.mark.system
def test_a_third_party_rl_algorithm_is_one_file_and_runs_through_the_stage(tmp_path, plugins, tiny, monkeypatch):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(EXAMPLE)], check=True)
    monkeypatch.syspath_prepend(str(site))
    import alignflow_plugin_example.plugin as example
    from alignflow_plugin_example.reinforce import Reinforce

    plugins.add(example, "example")
    try:
        # rewards [1, 0, 0, 1, 1, 1]: the batch mean is 2/3, so A = R - 2/3 on every token of a response
        rollout = Rollout(rewards=torch.tensor([1.0, 0, 0, 1, 1, 1]), group=torch.tensor([0, 0, 0, 0, 1, 1]),
                          response_mask=torch.ones(6, 2), old_logprobs=torch.zeros(6, 2), max_new_tokens=2)
        advantages, returns = Reinforce().advantages(rollout)
        assert returns is None
        assert torch.allclose(advantages[:, 0], torch.tensor([1, -2, -2, 1, 1, 1]) / 3)
        log = []
        ctx = make_ctx(tmp_path, plugins, tiny, "reinforce", write_rows(tmp_path / "rl.jsonl", ["x"] * 4), log)
        result = run_rl(ctx)
        assert result.metrics["steps"] == 2 and KEYS <= set(log[0][1])
        assert "actor/kl_ref_k3" not in log[0][1]  # no reference model: none was loaded
        before, after = weights(tiny), weights(result.outputs["model"])
        assert any(not torch.equal(before[k], after[k]) for k in before)
    finally:
        plugins.remove("example")


def test_grpo_learns_an_easy_reward(tmp_path, plugins, tiny):
    """P(first token is ASCII) rises under GRPO with a reward for exactly that."""
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 8)
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", data, log, max_steps=6, prompts_per_step=4, group_size=8,
                   micro_batch_size=32, lr=1e-2, generation={"max_new_tokens": 1})
    result = run_rl(ctx)

    def p_ascii(path):
        tok, model = load_tokenizer(path), load_model(path)
        ids = torch.tensor(tok(["3+3="]).input_ids)
        with torch.no_grad():
            logits = model(ids).logits[0, -1]
        return logits.softmax(-1)[:ASCII].sum().item()

    start, end = p_ascii(tiny), p_ascii(result.outputs["model"])
    assert end > start + 0.1, (start, end)  # 0.48 -> 0.67 when measured
    rewards = [m["reward/total/mean"] for _, m in log[:-1]]
    assert sum(rewards[-2:]) > sum(rewards[:2])


def test_resume_mid_stage_gives_the_uninterrupted_weights(tmp_path, plugins, tiny):
    """PPO (reference, critic) killed after step 2 of 3 resumes from step 1 and ends bit-identical."""
    data = write_rows(tmp_path / "rl.jsonl", ["x"] * 4)
    whole = run_rl(make_ctx(tmp_path / "a", plugins, tiny, "ppo", data, [], max_steps=3))

    def crash(metrics, step):
        if step == 2:
            raise KeyboardInterrupt

    ctx = make_ctx(tmp_path / "b", plugins, tiny, "ppo", data, [], max_steps=3)
    ctx.log_metrics = crash
    with pytest.raises(KeyboardInterrupt):
        run_rl(ctx)
    assert ctx.resuming()
    log = []
    resumed = run_rl(make_ctx(tmp_path / "b", plugins, tiny, "ppo", data, log, max_steps=3))
    assert [step for step, _ in log[:-1]] == [2, 3]
    a, b = weights(whole.outputs["model"]), weights(resumed.outputs["model"])
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dapo_refills_filtered_groups(tmp_path, plugins, tiny):
    """3 of 4 prompts always score 0 (groups DAPO drops): it generates more rounds to keep 2 groups."""
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["dead", "x", "dead", "dead"])
    ctx = make_ctx(tmp_path, plugins, tiny, "dapo", data, log, max_steps=1, group_size=8, micro_batch_size=8)
    run_rl(ctx)
    metrics = log[0][1]
    assert metrics["sampling/rounds"] >= 2
    assert metrics["sampling/groups_kept"] == 2  # trimmed to exactly prompts_per_step
    assert metrics["sampling/groups_filtered"] >= metrics["sampling/rounds"]  # a dead prompt in every round


def test_a_step_with_every_group_filtered_changes_nothing(tmp_path, plugins, tiny):
    """DAPO's refill cap reached with no group kept: the step runs no update, and the run goes on."""
    log = []
    data = write_rows(tmp_path / "rl.jsonl", ["dead"] * 4)
    algorithm = {"name": "dapo", "config": {"max_gen_batches": 2}}
    result = run_rl(make_ctx(tmp_path, plugins, tiny, algorithm, data, log, max_steps=2))
    assert [(m["sampling/rounds"], m["sampling/groups_kept"]) for _, m in log[:-1]] == [(2, 0), (2, 0)]
    before, after = weights(tiny), weights(result.outputs["model"])
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_sampler_logprobs_are_the_trainers_at_the_sampling_temperature(tiny):
    """pi_old comes from the sampler, not an extra forward: it must equal the trainer's log-probs."""
    from alignflow.core.spec.settings import GenerationSettings
    from alignflow.plugins.hf import HFSampler

    tok, model = load_tokenizer(tiny), load_model(tiny)
    sampler = HFSampler()
    sampler.load(model, tok)
    gen = GenerationSettings(max_new_tokens=6, temperature=0.7)
    prompts = tok(["1+2=", "34*5="]).input_ids
    g = sampler.generate(prompts, 2, gen, seed=0)
    samples = Samples([prompts[i] for i in g.prompt_index], g.completion_ids, g.logprobs, g.prompt_index,
                      [0.0] * 4, [False] * 4, g.truncated, {})
    batch = to_batch(samples, tok.pad_token_id, 6)
    r = batch.rollout
    with torch.no_grad():
        current = token_logprobs(model, batch.input_ids, batch.attention_mask, r.response_mask, temperature=0.7)
    assert r.response_mask.sum(-1).tolist() == [len(c) for c in g.completion_ids]
    torch.testing.assert_close(current, r.old_logprobs, atol=1e-4, rtol=0)
    # right padding: each micro-batch view is cut to its own longest sequence
    ids, attention, _ = batch.view(torch.tensor([0]))
    assert ids.shape[1] == len(prompts[0]) + len(g.completion_ids[0]) and attention.all()


def test_minibatches_hold_whole_groups_in_a_seeded_order():
    group = torch.tensor([5, 5, 9, 9, 2, 2, 7, 7])
    parts = minibatches(group, 2, torch.Generator().manual_seed(0))
    assert sorted(torch.cat(parts).tolist()) == list(range(8))
    for part in parts:
        assert len(part) == 4 and all((group == g).sum() == (group[part] == g).sum() for g in group[part])
    again = minibatches(group, 2, torch.Generator().manual_seed(0))
    assert all(torch.equal(a, b) for a, b in zip(parts, again))



def test_reward_counts_reach_the_step_metrics():
    """A reward's own counts (code_exec's timeouts) and failed samples are logged by rl steps too."""
    from alignflow.flows.stages.rl.rollout import Samples, rollout_metrics

    def part(counts):
        return Samples([[1], [2]], [[5], [6]], None, [0, 0], [1.0, 0.0], [True, False], [False, False],
                       {"code_exec": [1.0, 0.0]}, counts=counts)

    drawn = Samples.join([part({"reward/code_exec/timeout": 1.0}), part({"reward/code_exec/timeout": 2.0,
                                                                        "reward/code_exec/failed": 1.0})])
    metrics = rollout_metrics(drawn.take([0, 1]), drawn)
    assert metrics["reward/code_exec/timeout"] == 3.0 and metrics["reward/code_exec/failed"] == 1.0
