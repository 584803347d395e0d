"""The rl and evaluate stages on multi-turn episodes of the tiny model: metrics, masks, resume, failures."""

import json
import multiprocessing
import os
import signal

import pytest
import torch

from alignflow.core import SpecError, hookimpl
from alignflow.core.environments import Environment, Step
from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.settings import EvaluateSettings
from alignflow.core.train.models import load_model
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.evaluate import run_evaluate
from alignflow.flows.stages.rl.stage import run_rl
from tests.flows.stages.rl.test_rl_stage import make_ctx
from helpers.plugins import registered
from helpers.stopping import stop_early


class Echo(Environment):
    """Replies to every turn, ends only at max_turns; a turn's reward is half its share of ASCII characters,
    and the first turn of an odd-numbered prompt ("1*1=", "3*3=") earns 1 more, so the prompts' returns differ."""

    def reset(self, row, seed):
        self.bonus = float(int(row["prompt"].split("*")[0]) % 2)
        return row["prompt"]

    def step(self, turn):
        score = sum(c.isascii() for c in turn.text) / max(len(turn.text), 1)
        return Step(f"\n[{turn.index}]\n", reward=score / 2 + (self.bonus if turn.index == 0 else 0.0))


class Gym(Environment):
    """Answers as gymnasium's `step` does, with a tuple: every episode fails."""

    def step(self, turn):
        return None, 1.0, True, {}


class TestEnvironments:
    @staticmethod
    @hookimpl
    def register_environments(register):
        register("echo", Echo)
        register("gym", Gym)


@pytest.fixture(scope="module")
def plugins():
    with registered(TestEnvironments, "test_rl_environment") as p:
        yield p


@pytest.fixture(scope="module")
def tiny(tiny_model, tmp_path_factory):
    """The tiny model, made to end its turns after a few tokens."""
    import shutil

    out = tmp_path_factory.mktemp("stopping")
    shutil.copytree(tiny_model(), out, dirs_exist_ok=True)
    model = stop_early(load_model(out))
    model.save_pretrained(out)
    return out


def rows(path, n=4):
    path.write_text("".join(json.dumps({"prompt": f"{i}*{i}=", "answer": str(i * i)}) + "\n" for i in range(n)))
    return path


def rl_ctx(root, plugins, model, dataset, log, environment, algorithm="grpo", **settings):
    """The rl stage on `environment` alone (no other reward), turns of at most 6 tokens."""
    return make_ctx(root, plugins, model, algorithm, dataset, log, rewards=(), environment=environment,
                    **{"generation": {"max_new_tokens": 6}, **settings})


ECHO = {"name": "echo", "max_turns": 3, "max_tokens": 40}


def test_rl_trains_on_episodes_and_reports_them(tmp_path, plugins, tiny):
    log = []
    result = run_rl(rl_ctx(tmp_path, plugins, tiny, rows(tmp_path / "rl.jsonl"), log, ECHO))
    step = log[0][1]
    assert step["episode/turns"] > 1  # turns end at the stop token or at max_new_tokens (which ends the episode)
    assert step["episode/tool_calls"] == 0.0
    assert sum(step[f"episode/ended_{e}"] for e in ("done", "max_turns", "max_tokens", "turn_tokens", "error")) == 1.0
    assert step["reward/echo/mean"] == step["reward/total/mean"] > 0
    last = log[-2][1]  # the final metrics (`run --metrics`, the manifest) keep the last step's episode records
    assert {k: v for k, v in result.metrics.items() if k.startswith("episode/")} == {
        k: v for k, v in last.items() if k.startswith("episode/")} and "episode/turns" in result.metrics
    before, after = load_model(tiny).state_dict(), load_model(result.outputs["model"]).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_gigpo_trains_on_episodes_with_an_advantage_per_turn(tmp_path, plugins, tiny, monkeypatch):
    """Echo's reply to turn k is "[k]" in every episode, so (anchor_state: observation) the turns after it share
    a state across a group's episodes: the step advantages differ from turn to turn within an episode."""
    from alignflow.plugins.gigpo import GiGPO

    seen, advantages = [], GiGPO.advantages

    def recorded(self, rollout):
        adv, returns = advantages(self, rollout)
        seen.append((rollout, adv))
        return adv, returns

    monkeypatch.setattr(GiGPO, "advantages", recorded)
    log = []
    result = run_rl(rl_ctx(tmp_path, plugins, tiny, rows(tmp_path / "rl.jsonl"), log, ECHO, algorithm="gigpo"))
    assert seen and all(0 < m["gigpo/anchored_steps"] <= 1 for _, m in log[:-1])
    per_turn = []  # the distinct advantages on each turn of each row of several turns
    for rollout, adv in seen:
        for row in range(adv.shape[0]):
            turns = rollout.turns[row]
            if turns.max() > 0:
                values = [adv[row][turns == t] for t in range(int(turns.max()) + 1)]
                assert all(v.unique().numel() == 1 for v in values)  # one advantage per turn
                per_turn.append(len({round(v[0].item(), 6) for v in values}))
    assert per_turn and max(per_turn) > 1  # some episode's turns got different advantages
    before, after = load_model(tiny).state_dict(), load_model(result.outputs["model"]).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_gigpo_refuses_a_stage_without_an_environment(tmp_path, plugins, tiny):
    ctx = make_ctx(tmp_path, plugins, tiny, "gigpo", rows(tmp_path / "rl.jsonl"), [], rewards=("math_accuracy",))
    with pytest.raises(SpecError, match="GiGPO learns from the turns of multi-turn episodes"):
        run_rl(ctx)


def _killed_at_step_2(root, model, data):  # in a child process: SIGKILL itself once step 2 is logged
    with registered(TestEnvironments, "test_rl_environment") as plugins:
        ctx = rl_ctx(root, plugins, model, data, [], ECHO, max_steps=3)
        ctx.log_metrics = lambda metrics, step: step == 2 and os.kill(os.getpid(), signal.SIGKILL)
        run_rl(ctx)


@pytest.mark.system
def test_resume_on_episodes_after_kill_9_gives_the_uninterrupted_weights(tmp_path, plugins, tiny):
    data = rows(tmp_path / "rl.jsonl")
    whole = run_rl(rl_ctx(tmp_path / "a", plugins, tiny, data, [], ECHO, max_steps=3))
    killed = multiprocessing.get_context("spawn").Process(target=_killed_at_step_2, args=(tmp_path / "b", tiny, data))
    killed.start()
    killed.join(timeout=300)
    assert killed.exitcode == -signal.SIGKILL
    log = []
    resumed = run_rl(rl_ctx(tmp_path / "b", plugins, tiny, data, log, ECHO, max_steps=3))
    assert log[0][0] >= 2  # resumed from a checkpoint, not started over
    a, b = load_model(whole.outputs["model"]).state_dict(), load_model(resumed.outputs["model"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.system
def test_overlapped_episodes_with_fixed_weights_are_the_synchronous_ones(tmp_path, plugins, tiny):
    """lr 0: the worker runs each later step's whole episodes (every turn, the environment stepped there) on
    the staged weights with the same seeds, so it makes exactly the episodes the stage would have made."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the worker's count: the same kernels, so the same samples on both sides
    try:
        data = rows(tmp_path / "rl.jsonl")
        runs = {}
        for overlap in (False, True):
            log = []
            run_rl(rl_ctx(tmp_path / str(overlap), plugins, tiny, data, log, ECHO, max_steps=3, lr=0.0,
                          async_rollouts=overlap))
            runs[overlap] = [m for _, m in log[:-1]]
    finally:
        torch.set_num_threads(before)
    assert [m["rollout/staleness"] for m in runs[True]] == [0.0, 1.0, 1.0]
    for key in ("reward/echo/mean", "episode/turns", "episode/ended_max_turns", "response_length/mean"):
        assert [m[key] for m in runs[True]] == [m[key] for m in runs[False]], key


@pytest.mark.system
def test_partial_rollouts_run_episodes_k_steps_ahead_within_the_bound(tmp_path, plugins, tiny):
    """k = 2 on the newest weights, switching mid-episode (`partial`): which weights sample which turn depends on
    timing, so the run asserts the bound (no sample more than 2 updates old), that every sample and token is
    counted at some staleness, and that the manifest calls the stage timing-dependent."""
    log = []
    result = run_rl(rl_ctx(tmp_path, plugins, tiny, rows(tmp_path / "rl.jsonl"), log, ECHO, max_steps=4,
                           async_rollouts=True, max_staleness=2, async_weights="partial"))
    steps = [m for _, m in log[:-1]]
    assert steps[0]["rollout/staleness"] == 0.0 and all(0 <= m["rollout/staleness"] <= 2 for m in steps)
    for m in steps:
        for kind in ("staleness_share", "token_share"):
            shares = {k: v for k, v in m.items() if k.startswith(f"rollout/{kind}/")}
            assert sum(shares.values()) == pytest.approx(1.0) and all(int(k.split("/")[-1]) <= 2 for k in shares)
    assert (result.fingerprint["max_staleness"], result.fingerprint["timing_dependent"]) == (2, True)


def test_evaluate_scores_episodes_with_the_environment_first(tmp_path, plugins, tiny):
    data = rows(tmp_path / "test.jsonl")
    spec = StageSpec(kind="evaluate", inputs={"model": str(tiny), "dataset": str(data)},
                     environment={"name": "math_tools", "max_turns": 2}, rewards=["math_accuracy"], sampler="hf")
    settings = EvaluateSettings(n=2, k=[1, 2], generation={"max_new_tokens": 8, "temperature": 1.0})
    (tmp_path / "work").mkdir()
    ctx = StageContext("eval", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                       tmp_path / "checkpoints", 0, lambda m, s: None, plugins)
    result = run_evaluate(ctx)
    m = result.metrics
    assert {"accuracy", "pass_at_2", "reward/math_tools/mean", "reward/math_accuracy/mean", "episode/turns",
            "episode/tool_errors", "episode/ended_done"} <= set(m)
    samples = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    assert len(samples) == 8 and all(set(s["rewards"]) == {"math_tools", "math_accuracy"} for s in samples)


def test_an_environment_failing_every_episode_stops_the_stage_as_a_failing_reward_does(tmp_path, plugins, tiny):
    from alignflow.core.environments import EpisodeError

    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1*1="}\n{"prompt": "2*2="}\n')  # no answer: nothing here reads one
    spec = StageSpec(kind="evaluate", inputs={"model": str(tiny), "dataset": str(data)},
                     environment={"name": "gym", "max_turns": 2}, sampler="hf")
    settings = EvaluateSettings(n=1, generation={"max_new_tokens": 6})
    (tmp_path / "work").mkdir()
    ctx = StageContext("eval", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                       tmp_path / "checkpoints", 0, lambda m, s: None, plugins)
    with pytest.raises(EpisodeError, match=r"environment 'gym' failed on every episode of a batch of 2; the first: "
                                           r"environment 'gym', turn 0: step returned tuple; expected a Step"):
        run_evaluate(ctx)


def test_rejection_sampling_keeps_each_prompts_best_episode_as_a_conversation(tmp_path, plugins, tiny):
    from alignflow.core.spec.settings import SampleSettings
    from alignflow.core.train.datasets import conversation_ids
    from alignflow.core.train.models import load_tokenizer
    from alignflow.flows.stages.rejection import run_rejection_sampling

    data = rows(tmp_path / "prompts.jsonl")
    (tmp_path / "work").mkdir()

    def ctx(output):
        spec = StageSpec(kind="rejection_sampling", inputs={"model": str(tiny), "dataset": str(data)},
                         environment=ECHO, sampler="hf")
        settings = SampleSettings(n=4, output=output, generation={"max_new_tokens": 6, "temperature": 1.0})
        return StageContext("rs", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                            tmp_path / "checkpoints", 0, lambda m, s: None, plugins)

    result = run_rejection_sampling(ctx("sft"))
    kept = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    # the odd prompts' episodes earn >= 1 (correct) where a turn ends by its stop token (~2 in 3 of them
    # do, so 4 samples a prompt), the even ones' < 1
    assert sorted(r["messages"][0]["content"] for r in kept) == ["1*1=", "3*3="]
    tok = load_tokenizer(tiny)
    for r in kept:
        assert r["answer"] in ("1", "9") and r["reward"] >= 1 and "prompt" not in r
        turns = [m for m in r["messages"] if m["role"] == "assistant"]
        ids, labels = conversation_ids(tok, r["messages"])
        assert len(turns) >= 1 and sum(label != -100 for label in labels) == sum(
            len(tok(t["content"], add_special_tokens=False).input_ids) + 1 for t in turns)
    with pytest.raises(SpecError, match="settings.output: 'pairs' writes single-turn pairs"):
        run_rejection_sampling(ctx("pairs"))
