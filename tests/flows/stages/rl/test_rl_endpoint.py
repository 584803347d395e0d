"""The rl and evaluate stages on episodes an `openai`-SDK agent drives through the policy endpoint: they train
and report per episode, a harness that drops history splits its episodes into samples (counted), and the
overlapped rollout worker serves the endpoint from its own process."""

import json

import pytest

from alignflow.core.spec.schema import StageSpec
from alignflow.core.spec.settings import EvaluateSettings
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.evaluate import run_evaluate
from alignflow.flows.stages.rl.stage import run_rl
from tests.flows.stages.rl.test_rl_environment import plugins, rows, tiny  # noqa: F401 (fixtures)
from tests.flows.stages.rl.test_rl_stage import make_ctx, weights

pytestmark = pytest.mark.system  # the endpoint's server; with overlap, the rollout worker's process

AGENT = '''
def agent(client, row, seed):
    """Two calls; on the prompt 1*1= the harness keeps only its last message before the second (a split)."""
    messages = [{"role": "user", "content": row["prompt"]}]
    text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content or ""
    messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "\\n[again]\\n"}]
    if row["prompt"] == "1*1=":
        messages = messages[-1:]
    client.chat.completions.create(model="policy", messages=messages)
    return sum(c.isascii() for c in text) / max(len(text), 1) / 2 + float(row["prompt"] == "1*1=")
'''


def environment(tmp_path):
    (tmp_path / "agent.py").write_text(AGENT)
    return {"name": "openai_agent", "config": {"function": f"{tmp_path / 'agent.py'}:agent"}, "max_turns": 2,
            "max_tokens": 40}


@pytest.mark.parametrize("overlap", [False, True])
def test_rl_trains_through_the_endpoint(tmp_path, plugins, tiny, overlap):  # noqa: F811
    log = []
    ctx = make_ctx(tmp_path, plugins, tiny, "grpo", rows(tmp_path / "rl.jsonl"), log, rewards=(),
                   environment=environment(tmp_path), generation={"max_new_tokens": 6}, async_rollouts=overlap,
                   prompts_per_step=4, group_size=2)
    result = run_rl(ctx)
    steps = [m for _, m in log[:-1] if "episode/turns" in m]  # the last entry: the stage's final metrics
    assert len(steps) == 2 and log[-1][1]["episode/turns"] == steps[-1]["episode/turns"]
    for step in steps:
        assert step["episode/turns"] == 2.0 and step["episode/ended_done"] == 1.0
        assert step["episode/splits"] == 0.25  # the 2 episodes of 1*1=, of 8, split once each
    changed = [k for k, v in weights(result.outputs["model"]).items() if not v.equal(weights(tiny)[k])]
    assert changed


def test_evaluate_counts_each_driven_episode_once(tmp_path, plugins, tiny):  # noqa: F811
    data = rows(tmp_path / "test.jsonl")
    spec = StageSpec(kind="evaluate", inputs={"model": str(tiny), "dataset": str(data)},
                     environment=environment(tmp_path), sampler="hf")
    settings = EvaluateSettings(n=2, k=[1, 2], generation={"max_new_tokens": 6, "temperature": 1.0})
    (tmp_path / "work").mkdir()
    ctx = StageContext("eval", spec, settings, {"model": tiny, "dataset": data}, tmp_path / "work",
                       tmp_path / "checkpoints", 0, lambda m, s: None, plugins)
    m = run_evaluate(ctx).metrics
    # only 1*1= earns >= 1 (the bonus): 2 of its episodes of 8, whatever their split samples
    assert m["accuracy"] == 0.25 and m["pass_at_2"] == 0.25 and m["episode/splits"] == 0.25
    samples = [json.loads(line) for line in (tmp_path / "work").rglob("samples.jsonl").__next__().read_text()
               .splitlines()]
    assert len(samples) == 10  # a row per sample: 8 episodes, two of them split
