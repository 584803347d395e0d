"""Pipeline specs: every error names the YAML file, the stage and the field, before any compute."""

import pytest
from pydantic import Field

from alignflow.core import Algorithm, PluginConfig, Sampler, SpecError, hookimpl
from alignflow.core.plugins import Plugins
from alignflow.core.spec.schema import load_spec


class Toy(Algorithm):
    """Toy preference algorithm."""

    class Config(PluginConfig):
        beta: float = Field(0.1, gt=0)

    stage = "preference"


class ToyRL(Algorithm):
    """Toy RL algorithm."""

    stage = "rl"


class ToySampler(Sampler):
    """Toy sampler."""


def exact(prompts, completions, answer, **_):
    """Toy reward."""
    return [float(c == a) for c, a in zip(completions, answer)]


class ToyPlugin:
    @staticmethod
    @hookimpl
    def register_algorithms(register):
        register("toy", Toy)
        register("toy_rl", ToyRL)

    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("exact", exact)

    @staticmethod
    @hookimpl
    def register_samplers(register):
        register("toy_sampler", ToySampler)


@pytest.fixture
def plugins():
    p = Plugins()
    p.add(ToyPlugin, "toy")
    return p


GOOD = """
name: demo
stages:
  prefs:
    kind: preference
    inputs: {model: ./base, dataset: data/pairs.jsonl}
    algorithm: {name: toy, config: {beta: 0.5}}
    settings: {lr: 1.0e-5}
  rl:
    kind: rl
    inputs: {model: "stage:prefs", dataset: data/rl.jsonl}
    algorithm: toy_rl
    sampler: toy_sampler
    rewards: [{name: exact, weight: 2.0}]
  eval:
    kind: evaluate
    inputs: {model: "stage:rl", dataset: data/test.jsonl}
    sampler: toy_sampler
    rewards: [exact]
"""


def write(tmp_path, text):
    path = tmp_path / "pipe.yaml"
    path.write_text(text)
    return path


def test_good_spec_orders_stages_by_dependency(tmp_path, plugins):
    spec = load_spec(write(tmp_path, GOOD), plugins)
    assert spec.order() == ["prefs", "rl", "eval"]
    assert spec.stages["rl"].rewards[0].weight == 2.0
    assert spec.stages["rl"].references() == {"model": "prefs"}


def test_cycle_is_named(tmp_path, plugins):
    text = GOOD.replace("model: ./base", 'model: "stage:eval"')
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), plugins)
    msg = str(info.value)
    assert str(tmp_path / "pipe.yaml") in msg and "cycle" in msg
    assert all(stage in msg for stage in ("prefs", "rl", "eval"))


def test_dangling_reference_names_file_stage_and_field(tmp_path, plugins):
    text = GOOD.replace('"stage:prefs"', '"stage:prefz"')
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), plugins)
    assert str(info.value).startswith(f"{tmp_path / 'pipe.yaml'}: stage 'rl', inputs.model: refers to stage 'prefz'")


def test_an_algorithm_of_another_kind_is_refused_by_name(tmp_path, plugins):
    text = "name: p\nstages:\n  prm:\n    kind: prm\n    inputs: {model: ./base, dataset: steps.jsonl}\n" \
           "    algorithm: toy_rl\n"
    with pytest.raises(SpecError, match=r"stage 'prm', algorithm: 'toy_rl' serves 'rl' stages, not 'prm'"):
        load_spec(write(tmp_path, text), plugins)


def test_bad_plugin_config_field_names_the_field(tmp_path, plugins):
    text = GOOD.replace("beta: 0.5", "beta: -1")
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), plugins)
    msg = str(info.value)
    assert "stage 'prefs', algorithm.config.beta" in msg and "greater than 0" in msg


def test_unknown_config_field_is_rejected(tmp_path, plugins):
    text = GOOD.replace("beta: 0.5", "betta: 0.5")
    with pytest.raises(SpecError, match=r"stage 'prefs', algorithm.config.betta: Extra inputs are not permitted"):
        load_spec(write(tmp_path, text), plugins)


def test_unknown_plugin_name_suggests_the_closest(tmp_path, plugins):
    text = GOOD.replace("rewards: [exact]", "rewards: [exakt]")
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), plugins)
    assert "stage 'eval', rewards[0].name: unknown reward 'exakt'; did you mean 'exact'?" in str(info.value)


def test_every_plugin_problem_of_every_stage_is_reported_at_once(tmp_path, plugins):
    text = (GOOD.replace("algorithm: toy_rl", "algorithm: toy_rll")
            .replace("rewards: [{name: exact, weight: 2.0}]", "rewards: [{name: exactt, weight: 2.0}]")
            .replace("rewards: [exact]", "rewards: [exakt]"))
    with pytest.raises(SpecError) as info:
        load_spec(write(tmp_path, text), plugins)
    msg = str(info.value)
    assert "3 problems" in msg
    assert "stage 'rl', algorithm.name: unknown algorithm 'toy_rll'" in msg
    assert "stage 'rl', rewards[0].name: unknown reward 'exactt'" in msg  # the same stage as the algorithm
    assert "stage 'eval', rewards[0].name: unknown reward 'exakt'" in msg


def test_algorithm_of_the_wrong_stage_kind(tmp_path, plugins):
    text = GOOD.replace("algorithm: toy_rl", "algorithm: toy")
    with pytest.raises(SpecError, match=r"stage 'rl', algorithm: 'toy' serves 'preference' stages, not 'rl'"):
        load_spec(write(tmp_path, text), plugins)


def test_a_misplaced_algorithm_with_its_own_config_is_named_before_its_config_is_checked(tmp_path, plugins):
    text = GOOD.replace("algorithm: toy_rl", "algorithm: {name: toy, config: {beta: 0.5, clip_eps: 0.2}}")
    with pytest.raises(SpecError, match=r"stage 'rl', algorithm: 'toy' serves 'preference' stages, not 'rl'"):
        load_spec(write(tmp_path, text), plugins)  # not "clip_eps: Extra inputs are not permitted"


def test_bad_settings_field(tmp_path, plugins):
    text = GOOD.replace("lr: 1.0e-5", "lr: fast")
    with pytest.raises(SpecError, match=r"stage 'prefs', settings.lr: Input should be a valid number"):
        load_spec(write(tmp_path, text), plugins)


def test_missing_required_input_and_unknown_input(tmp_path, plugins):
    with pytest.raises(SpecError, match=r"stage 'prefs', inputs.dataset: required by a 'preference' stage"):
        load_spec(write(tmp_path, GOOD.replace(", dataset: data/pairs.jsonl", "")), plugins)
    with pytest.raises(SpecError, match=r"inputs.critic: not an input of a 'preference' stage"):
        load_spec(write(tmp_path, GOOD.replace("dataset: data/pairs.jsonl", "critic: x")), plugins)


def test_unknown_stage_kind_and_top_level_field(tmp_path, plugins):
    with pytest.raises(SpecError, match=r"stages.prefs.kind: Input should be 'select', 'sft'"):
        load_spec(write(tmp_path, GOOD.replace("kind: preference", "kind: dpo")), plugins)
    with pytest.raises(SpecError, match=r"staegs: Extra inputs are not permitted"):
        load_spec(write(tmp_path, GOOD + "staegs: {}\n"), plugins)


def test_invalid_yaml_and_missing_file(tmp_path, plugins):
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(write(tmp_path, "name: [unclosed"), plugins)
    with pytest.raises(SpecError, match="no such pipeline file"):
        load_spec(tmp_path / "nope.yaml", plugins)


def test_a_partial_generation_block_of_a_greedy_default_stays_greedy():
    from alignflow.core.spec.settings import EvaluateSettings, RLSettings, TrainSettings

    assert TrainSettings(eval_generation={"max_new_tokens": 128}).eval_generation.temperature == 0.0
    assert EvaluateSettings(generation={"max_new_tokens": 9}).generation.temperature == 0.0
    assert EvaluateSettings(generation={"temperature": 0.7}).generation.temperature == 0.7  # said: kept
    assert RLSettings(generation={"max_new_tokens": 8}).generation.temperature == 1.0  # rollouts sample
