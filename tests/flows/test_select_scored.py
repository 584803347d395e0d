"""A select stage with rewards: every row scored under `rewards.NAME` before the selectors, which can
keep the best rows (quality selection of SFT data); bad rows are named."""

import json

import pytest

import alignflow.plugins.quality
import alignflow.plugins.subsample
from alignflow.core import DataError, SpecError, hookimpl
from alignflow.core.plugins import Plugins
from alignflow.core.spec.settings import SelectSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.stages.select import run_select
from helpers.stages import stage_context

SEEN: list[dict] = []


def digits(prompts, completions, answer=None, **_):
    """How many digits the completion has; records the columns it was given."""
    SEEN.append({"answer": answer})
    return [float(sum(ch.isdigit() for ch in c)) for c in completions]


def fails_on_x(prompts, completions, **_):
    return [None if "x" in c else 1.0 for c in completions]


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("digits", digits)
        register("fails_on_x", fails_on_x)


@pytest.fixture(scope="module")
def plugins():
    p = Plugins()
    p.add(alignflow.plugins.quality, "quality")
    p.add(alignflow.plugins.subsample, "subsample")
    p.add(Rewards, "rewards")
    return p


def select(tmp_path, plugins, rows, rewards, selectors):
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_spec({"name": "s", "stages": {"pick": {
        "kind": "select", "inputs": {"dataset": str(data)}, "rewards": rewards, "selectors": selectors}}},
        plugins=plugins)
    result = run_select(stage_context(tmp_path, spec, settings_model=SelectSettings, inputs={"dataset": data},
                                      plugins=plugins))
    return result, [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]


ROWS = [
    {"prompt": "a", "completion": "1", "answer": "A"},
    {"prompt": "b", "completion": "123", "answer": "B"},
    {"prompt": "a ", "completion": "12x", "answer": "C"},  # the same prompt as row 1 after stripping
    {"prompt": "c", "completion": "no digits", "answer": "D"},
]


def test_rows_are_scored_and_the_best_kept_one_per_prompt(tmp_path, plugins):
    SEEN.clear()
    result, kept = select(tmp_path, plugins, ROWS, ["digits", {"name": "fails_on_x", "weight": 0}],
                          [{"name": "quality", "config": {"column": "rewards.digits", "k": 2}}])
    # digits: 1, 3, 2, 0. Top 2 with one per prompt: "123" (3), then "12x" (2, prompt "a "), whose cluster
    # "a" then blocks "1" (1): the rows keep their input order.
    assert [r["completion"] for r in kept] == ["123", "12x"]
    assert kept[0]["rewards"] == {"digits": 3.0, "fails_on_x": 1.0}
    assert kept[1]["rewards"] == {"digits": 2.0, "fails_on_x": None}  # a failed score is written as null
    assert kept[0]["answer"] == "B"  # the other columns stay
    assert SEEN[0]["answer"] == ["A", "B", "C", "D"]  # and reach the rewards, row-aligned
    m = result.metrics
    assert (m["rows_in"], m["rows_out"]) == (4.0, 2.0)
    assert m["reward/digits/mean"] == pytest.approx(6 / 4)
    assert m["reward/fails_on_x/none"] == 1.0


def test_existing_rewards_are_kept_beside_the_new_ones(tmp_path, plugins):
    rows = [{**r, "rewards": {"judge": i}} for i, r in enumerate(ROWS)]
    _, kept = select(tmp_path, plugins, rows, ["digits"], [])
    assert [r["rewards"] for r in kept] == [{"judge": i, "digits": d} for i, d in enumerate([1.0, 3.0, 2.0, 0.0])]


def test_a_row_without_a_completion_is_named(tmp_path, plugins):
    rows = ROWS[:2] + [{"prompt": "c", "answer": "D"}]
    with pytest.raises(DataError, match=r"rows\.jsonl:3: .* needs a string 'completion', got None"):
        select(tmp_path, plugins, rows, ["digits"], [])


def test_a_reward_that_would_overwrite_a_score_is_named(tmp_path, plugins):
    rows = ROWS[:1] + [{**ROWS[1], "rewards": {"digits": 9}}]
    with pytest.raises(DataError, match=r"rows\.jsonl:2: 'rewards' already holds"):
        select(tmp_path, plugins, rows, ["digits"], [])


def test_without_rewards_rows_are_untouched(tmp_path, plugins):
    _, kept = select(tmp_path, plugins, ROWS, [], [{"name": "subsample", "config": {"n": 10}}])
    assert kept == ROWS


def test_a_select_stage_takes_no_sampler(plugins):
    with pytest.raises(SpecError, match="a 'select' stage takes no sampler"):
        parse_spec({"name": "s", "stages": {"pick": {
            "kind": "select", "inputs": {"dataset": "x.jsonl"}, "rewards": ["digits"], "sampler": "hf"}}},
            plugins=plugins)
