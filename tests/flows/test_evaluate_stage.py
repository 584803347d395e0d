"""The evaluate stage: accuracy, pass@k and per-level accuracy agree with the samples it writes."""

import json
import math

import pytest

import alignflow.plugins.hf
from alignflow.core import SpecError, hookimpl
from alignflow.core.plugins import Plugins
from alignflow.core.spec.settings import EvaluateSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.stages.evaluate import run_evaluate
from helpers.stages import stage_context


def even_length(prompts, completions, **_):
    """1 when the completion has an even number of characters: a coin flip the test can recount."""
    return [float(len(c) % 2 == 0) for c in completions]


def vowels(prompts, completions, **_):
    """A selector for best-of-n: how many vowels a completion has."""
    return [float(sum(ch in "aeiou" for ch in c)) for c in completions]


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("even_length", even_length)
        register("vowels", vowels)


@pytest.fixture(scope="module")
def plugins():
    p = Plugins()
    p.add(alignflow.plugins.hf, "hf")
    p.add(Rewards, "rewards")
    return p


def evaluate(tmp_path, plugins, model, rows, best_of=("vowels",)):
    data = tmp_path / "test.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = parse_spec({"name": "e", "stages": {"eval": {
        "kind": "evaluate", "inputs": {"model": str(model), "dataset": str(data)},
        "rewards": ["even_length", {"name": "vowels", "weight": 0}],
        "settings": {"n": 4, "k": [1, 2, 4], "best_of": list(best_of),
                     "generation": {"max_new_tokens": 6, "temperature": 1.0}}}}}, plugins=plugins)
    return run_evaluate(stage_context(tmp_path, spec, settings_model=EvaluateSettings, plugins=plugins))


def test_metrics_match_the_written_samples(tmp_path, plugins, tiny_model):
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a), "level": 1 + a % 2} for a in range(6)]
    result = evaluate(tmp_path, plugins, tiny_model(seed=1), rows)

    samples = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    assert len(samples) == 6 * 4
    assert all(s["correct"] == (len(s["completion"]) % 2 == 0) for s in samples)
    correct = [sum(s["correct"] for s in samples[i * 4:(i + 1) * 4]) for i in range(6)]
    m = result.metrics
    assert m["accuracy"] == pytest.approx(sum(correct) / 24)
    assert m["pass_at_1"] == pytest.approx(sum(correct) / 24)
    assert m["pass_at_4"] == pytest.approx(sum(c > 0 for c in correct) / 6)
    assert m["pass_at_2"] == pytest.approx(sum(1 - math.comb(4 - c, 2) / math.comb(4, 2) for c in correct) / 6)
    level1 = [c for i, c in enumerate(correct) if rows[i]["level"] == 1]
    assert m["accuracy/level_1"] == pytest.approx(sum(level1) / (4 * len(level1)))
    assert result.headline == "accuracy"
    # best-of-4 by vowels: each prompt's completion with the most vowels (the first of equals)
    picks = [max(samples[i * 4:(i + 1) * 4], key=lambda s: s["rewards"]["vowels"]) for i in range(6)]
    assert m["best_of_4/vowels"] == pytest.approx(sum(s["correct"] for s in picks) / 6)


def test_best_of_must_name_one_of_the_stages_rewards(tmp_path, plugins, tiny_model):
    with pytest.raises(SpecError, match=r"settings.best_of: 'vowel' is not one of the stage's rewards "
                                        r"\(even_length, vowels\)"):
        evaluate(tmp_path, plugins, tiny_model(seed=1), [{"prompt": "1+1=", "answer": "2"}], best_of=["vowel"])


def test_evaluate_rejects_rejection_sampling_settings():
    from pydantic import ValidationError

    for field, value in (("output", "pairs"), ("pairs_per_prompt", 4)):
        with pytest.raises(ValidationError, match=field):
            EvaluateSettings.model_validate({field: value})
