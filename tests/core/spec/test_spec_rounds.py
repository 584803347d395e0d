"""Loops in a spec: unrolled names and per-round inputs, and every bad loop named by its file and field."""

from __future__ import annotations

import copy

import pytest
import yaml

from alignflow.core import Algorithm, PluginConfig, SpecError, hookimpl
from alignflow.core.plugins import Plugins
from alignflow.core.spec.rounds import RoundOf, round_name, round_seed
from alignflow.core.spec.schema import parse_shape, parse_spec
from alignflow.flows.overrides import apply_overrides

SPEC = yaml.safe_load("""
name: loops
stages:
  sft: {kind: sft, inputs: {model: base, dataset: sft.jsonl}, algorithm: sft}
  self_improve:
    repeat: 3
    first: {dpo: "stage:sft"}
    stages:
      sample: {kind: rejection_sampling, inputs: {model: "stage:dpo@prev", dataset: rl.jsonl},
               rewards: [math_accuracy], settings: {output: pairs}}
      dpo: {kind: preference, inputs: {model: "stage:dpo@prev", reference: "stage:dpo@prev",
            dataset: "stage:sample"}, algorithm: dpo}
      eval: {kind: evaluate, inputs: {model: "stage:dpo", dataset: test.jsonl}, rewards: [math_accuracy]}
  final_eval: {kind: evaluate, inputs: {model: "stage:self_improve.dpo", dataset: test.jsonl},
               rewards: [math_accuracy]}
""")
SOURCE = "pipelines/x.yaml"


def parsed(raw=None):
    spec, problems = parse_shape(copy.deepcopy(raw or SPEC), SOURCE)
    assert problems == []
    return spec


def error(change) -> str:
    raw = copy.deepcopy(SPEC)
    change(raw, raw["stages"]["self_improve"])
    with pytest.raises(SpecError) as info:
        parse_shape(raw, SOURCE)
    return str(info.value)


def test_each_round_is_a_stage_reading_this_round_and_the_previous_one():
    spec = parsed()
    rounds = [f"{x}.r{r}" for r in (1, 2, 3) for x in ("sample", "dpo", "eval")]
    assert list(spec.stages) == ["sft", *rounds, "final_eval"]
    inputs = {name: spec.stages[name].inputs for name in spec.stages}
    assert inputs["sample.r1"] == {"model": "stage:sft", "dataset": "rl.jsonl"}  # first.dpo
    assert inputs["dpo.r1"] == {"model": "stage:sft", "reference": "stage:sft", "dataset": "stage:sample.r1"}
    assert inputs["sample.r3"] == {"model": "stage:dpo.r2", "dataset": "rl.jsonl"}
    assert inputs["dpo.r3"] == {"model": "stage:dpo.r2", "reference": "stage:dpo.r2", "dataset": "stage:sample.r3"}
    assert inputs["eval.r2"] == {"model": "stage:dpo.r2", "dataset": "test.jsonl"}
    assert inputs["final_eval"]["model"] == "stage:dpo.r3"  # stage:LOOP.X is the last round
    assert spec.round_of("dpo.r2") == RoundOf("self_improve", "dpo", 2) and spec.round_of("sft") is None
    assert spec.label("eval.r3") == "self_improve.eval" and spec.label("final_eval") == "final_eval"
    assert list(spec.written()) == ["sft", "self_improve.sample", "self_improve.dpo", "self_improve.eval",
                                    "final_eval"]
    order = spec.order()
    assert order.index("dpo.r1") < order.index("sample.r2") < order.index("dpo.r2") < order.index("final_eval")
    # the rounds are copies: a default filled on the loop's stage (the sampler) reaches every round
    assert {spec.stages[f"sample.r{r}"].sampler.name for r in (1, 2, 3)} == {"hf"}
    assert spec.stages["sample.r1"] is not spec.stages["sample.r2"]


def test_one_round_reads_first_and_first_may_be_a_path():
    spec = parsed(apply_overrides(SPEC, ["self_improve.repeat=1", "self_improve.first.dpo=models/base"]))
    assert [n for n in spec.stages if spec.round_of(n)] == ["sample.r1", "dpo.r1", "eval.r1"]
    assert spec.stages["dpo.r1"].inputs["model"] == "models/base"
    assert spec.stages["final_eval"].inputs["model"] == "stage:dpo.r1"


def test_outside_a_loop_one_round_can_be_read_by_its_name():
    spec = parsed(apply_overrides(SPEC, ["final_eval.inputs.model=stage:dpo.r2"]))
    assert spec.stages["final_eval"].inputs["model"] == "stage:dpo.r2"


def test_a_second_loop_reads_the_first_loops_last_round():
    raw = copy.deepcopy(SPEC)
    raw["stages"]["again"] = {"repeat": 2, "first": {"polish": "stage:self_improve.dpo"}, "stages": {
        "polish": {"kind": "sft", "inputs": {"model": "stage:polish@prev", "dataset": "stage:sample.r1"},
                   "algorithm": "sft"}}}
    spec = parsed(raw)
    assert spec.stages["polish.r1"].inputs == {"model": "stage:dpo.r3", "dataset": "stage:sample.r1"}
    assert spec.stages["polish.r2"].inputs["model"] == "stage:polish.r1"


def test_names_seeds_and_the_round_count_are_apart():
    assert round_name("dpo", 12) == "dpo.r12"
    assert [round_seed(7, r) for r in (1, 2, 3)] == [7, 8, 9]  # round 1 keeps the stage's seed


@pytest.mark.parametrize("change, expected", [
    (lambda raw, loop: loop.update(repeat=0), "stages.self_improve.repeat: expected an integer >= 1, got 0"),
    (lambda raw, loop: loop.update(repeat="3"), "stages.self_improve.repeat: expected an integer >= 1, got '3'"),
    (lambda raw, loop: loop.update(repeat=True), "stages.self_improve.repeat: expected an integer >= 1, got True"),
    (lambda raw, loop: loop.update(first={}),
     "stages.self_improve.stages.dpo.inputs.model: stage:dpo@prev needs first.dpo"),
    (lambda raw, loop: loop["stages"]["dpo"]["inputs"].update(model="stage:dpo@next"),
     "stages.self_improve.stages.dpo.inputs.model: stage:dpo@next: unknown `@next`"),
    (lambda raw, loop: loop["stages"]["dpo"]["inputs"].update(model="stage:dpo.r2"),  # a later round, by name
     "stages.self_improve.stages.dpo.inputs.model: stage:dpo.r2 names one round of this loop"),
    (lambda raw, loop: loop["stages"]["eval"]["inputs"].update(model="stage:self_improve.dpo"),
     "stages.self_improve.stages.eval.inputs.model: stage:self_improve.dpo would read this loop's last round"),
    (lambda raw, loop: raw["stages"]["final_eval"]["inputs"].update(model="stage:dpo.r4"),
     "stages.final_eval.inputs.model: stage:dpo.r4 reads a later round than loop 'self_improve' has"),
    (lambda raw, loop: loop["stages"]["dpo"]["inputs"].update(model="stage:dpoo@prev"),
     "stages.self_improve.stages.dpo.inputs.model: stage:dpoo@prev: 'dpoo' is not a stage of loop"),
    (lambda raw, loop: loop["stages"]["eval"]["inputs"].update(model="stage:nope"),
     "stages.self_improve.stages.eval.inputs.model: stage:nope refers to stage 'nope', which does not exist"),
    (lambda raw, loop: raw["stages"]["final_eval"]["inputs"].update(model="stage:dpo@prev"),
     "stages.final_eval.inputs.model: stage:dpo@prev outside a loop"),
    (lambda raw, loop: raw["stages"]["final_eval"]["inputs"].update(model="stage:self_improve.dpoo"),
     "stages.final_eval.inputs.model: stage:self_improve.dpoo names no stage of loop 'self_improve' "
     "(its stages: sample, dpo, eval)"),
    (lambda raw, loop: raw["stages"]["final_eval"]["inputs"].update(model="stage:dpo"),
     "stages.final_eval.inputs.model: stage:dpo: 'dpo' is a stage of loop 'self_improve'; "
     "read `stage:self_improve.dpo`"),
    (lambda raw, loop: loop["first"].update(dpo="stage:self_improve.dpo"),
     "stages.self_improve.first.dpo: stage:self_improve.dpo is this loop's own last round"),
    (lambda raw, loop: loop["first"].update(dpo="stage:sft@prev"),
     "stages.self_improve.first.dpo: stage:sft@prev: round 1 has no previous round"),
    (lambda raw, loop: loop["first"].update(evl="stage:sft"), "stages.self_improve.first.evl: not a stage of loop"),
    (lambda raw, loop: loop["first"].update(eval="stage:sft"),
     "stages.self_improve.first.eval: no stage of the loop reads `stage:eval@prev`"),
    (lambda raw, loop: loop.update(times=3), "stages.self_improve.times: Extra inputs are not permitted"),
    (lambda raw, loop: loop.update(stages={}), "stages.self_improve.stages: a loop needs at least one stage"),
    (lambda raw, loop: loop["stages"].update(inner={"repeat": 2, "stages": {}}),
     "stages.self_improve.stages: 'inner' is a loop: loops do not nest"),
    (lambda raw, loop: raw["stages"].update(eval=raw["stages"]["final_eval"]),
     "stages.self_improve.stages.eval: also the name of a stage outside the loop"),
    (lambda raw, loop: raw["stages"].update({"eval.r2": raw["stages"]["final_eval"]}),
     "stages.eval.r2: round 2 of stage 'eval' of loop 'self_improve' has that name"),
    (lambda raw, loop: raw["stages"].update(again=copy.deepcopy(loop)),
     "stages.again.stages.dpo: loop 'self_improve' has a stage 'dpo' too"),
    (lambda raw, loop: raw["stages"].update({"a.b": raw["stages"].pop("self_improve")}),
     "stages.a.b: a loop's name cannot hold '.' or '@'"),
])
def test_a_bad_loop_is_named_by_its_file_and_field(change, expected):
    assert f"{SOURCE}: {expected}" in error(change)


def test_problems_in_several_loop_fields_are_listed_together():
    msg = error(lambda raw, loop: (loop["first"].clear(),
                                   raw["stages"]["final_eval"]["inputs"].update(model="stage:dpo@prev")))
    assert msg.startswith(f"{SOURCE}: 4 problems with loops and their references:")
    assert msg.count("needs first.dpo") == 3 and "stages.final_eval.inputs.model" in msg


def test_a_cycle_inside_a_round_is_refused():
    msg = error(lambda raw, loop: loop["stages"]["sample"]["inputs"].update(model="stage:eval"))
    assert f"{SOURCE}: the stages form a cycle:" in msg and "sample.r1" in msg and "dpo.r1" in msg


def test_a_loop_stage_shape_problem_is_reported_once_under_its_label():
    raw = apply_overrides(SPEC, ["self_improve.stages.dpo.settings.lr=0"])
    spec, problems = parse_shape(raw, SOURCE)
    assert problems == [f"{SOURCE}: stage 'self_improve.dpo', settings.lr: 0 would train nothing; "
                        "expected a learning rate > 0"]


class Toy(Algorithm):
    """Toy preference algorithm."""

    class Config(PluginConfig):
        beta: float = 0.1

    stage = "preference"


class ToyPlugin:
    @staticmethod
    @hookimpl
    def register_algorithms(register):
        register("toy", Toy)


def test_a_loop_stage_plugin_problem_is_reported_once_under_its_label():
    plugins = Plugins()
    plugins.add(ToyPlugin, "toy")
    raw = {"name": "p", "stages": {"loop": {"repeat": 3, "first": {"p": "base"}, "stages": {
        "p": {"kind": "preference", "inputs": {"model": "stage:p@prev", "dataset": "pairs.jsonl"},
              "algorithm": {"name": "toy", "config": {"betta": 1}}}}}}}
    with pytest.raises(SpecError) as info:
        parse_spec(raw, SOURCE, plugins)
    assert str(info.value) == f"{SOURCE}: stage 'loop.p', algorithm.config.betta: Extra inputs are not permitted"
    raw["stages"]["loop"]["stages"]["p"]["algorithm"]["config"] = {"beta": 0.2}
    spec = parse_spec(raw, SOURCE, plugins)
    assert [spec.stages[f"p.r{r}"].inputs["model"] for r in (1, 2, 3)] == ["base", "stage:p.r1", "stage:p.r2"]


def test_set_reaches_a_loop_and_names_the_path_to_its_stages():
    spec = parsed(apply_overrides(SPEC, ["self_improve.repeat=4", "self_improve.stages.dpo.settings.lr=0.001"]))
    assert spec.stages["dpo.r4"].inputs["model"] == "stage:dpo.r3"
    assert {spec.stages[f"dpo.r{r}"].settings["lr"] for r in (1, 2, 3, 4)} == {0.001}
    with pytest.raises(SpecError, match=r"no stage 'dpo' .*as self_improve\.stages\.dpo\.FIELD"):
        apply_overrides(SPEC, ["dpo.r2.settings.lr=1e-3"])
