"""The rl and evaluate stages on multi-turn episodes of the tiny model: metrics, masks, resume, failures."""

import json

import pytest
import torch

from alignflow.core import SpecError, hookimpl
from alignflow.core.environments import Environment, Step
from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.settings import EvaluateSettings, RLSettings
from alignflow.core.train.models import load_model
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.evaluate import run_evaluate
from alignflow.flows.stages.rl.stage import run_rl
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


class TestEnvironments:
    @staticmethod
    @hookimpl
    def register_environments(register):
        register("echo", Echo)


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
    base = dict(max_steps=2, prompts_per_step=2, group_size=4, micro_batch_size=4, lr=1e-3,
                generation={"max_new_tokens": 6}, save_every=1)
    spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": str(dataset)}, algorithm=algorithm,
                     environment=environment, sampler="hf")
    (root / "work").mkdir(parents=True, exist_ok=True)
    return StageContext("rl", spec, RLSettings(**{**base, **settings}), {"model": model, "dataset": dataset},
                        root / "work", root / "checkpoints", 0, lambda m, step: log.append((step, m)), plugins)


ECHO = {"name": "echo", "max_turns": 3, "max_tokens": 40}


def test_rl_trains_on_episodes_and_reports_them(tmp_path, plugins, tiny):
    log = []
    result = run_rl(rl_ctx(tmp_path, plugins, tiny, rows(tmp_path / "rl.jsonl"), log, ECHO))
    step = log[0][1]
    assert step["episode/turns"] > 1  # turns end at the stop token or at max_new_tokens (which ends the episode)
    assert step["episode/tool_calls"] == 0.0
    assert sum(step[f"episode/ended_{e}"] for e in ("done", "max_turns", "max_tokens", "turn_tokens", "error")) == 1.0
    assert step["reward/echo/mean"] == step["reward/total/mean"] > 0
    before, after = load_model(tiny).state_dict(), load_model(result.outputs["model"]).state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_resume_on_episodes_gives_the_uninterrupted_weights(tmp_path, plugins, tiny):
    data = rows(tmp_path / "rl.jsonl")
    whole = run_rl(rl_ctx(tmp_path / "a", plugins, tiny, data, [], ECHO, max_steps=3))

    def crash(metrics, step):
        if step == 2:
            raise KeyboardInterrupt

    ctx = rl_ctx(tmp_path / "b", plugins, tiny, data, [], ECHO, max_steps=3)
    ctx.log_metrics = crash
    with pytest.raises(KeyboardInterrupt):
        run_rl(ctx)
    resumed = run_rl(rl_ctx(tmp_path / "b", plugins, tiny, data, [], ECHO, max_steps=3))
    a, b = load_model(whole.outputs["model"]).state_dict(), load_model(resumed.outputs["model"]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_overlapped_rollouts_refuse_an_environment(tmp_path, plugins, tiny):
    with pytest.raises(SpecError, match="overlap_rollouts: not yet with an environment"):
        run_rl(rl_ctx(tmp_path, plugins, tiny, rows(tmp_path / "rl.jsonl"), [], ECHO, overlap_rollouts=True))


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
        settings = SampleSettings(n=2, output=output, generation={"max_new_tokens": 6, "temperature": 1.0})
        return StageContext("rs", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                            tmp_path / "checkpoints", 0, lambda m, s: None, plugins)

    result = run_rejection_sampling(ctx("sft"))
    kept = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    # the odd prompts' episodes earn >= 1 (correct), the even ones' < 1
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
