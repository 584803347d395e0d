"""The stage-kind records: one per kind, one runner per kind, and every derived table agrees with them."""

from typing import get_args

import pytest

from alignflow.core.spec import kinds
from alignflow.core.contracts import StageKind
from alignflow.core.errors import SpecError
from alignflow.core.spec.kinds import KINDS, kinds_markdown, stage_kind


def test_each_kind_has_exactly_one_record_named_as_its_key():
    names = [record.name for record in kinds._RECORDS]
    assert len(names) == len(set(names)), "a kind described twice"
    assert all(KINDS[name].name == name for name in KINDS)


def test_the_spec_literal_lists_exactly_the_recorded_kinds():
    from alignflow.core.spec.stage import StageSpec

    assert list(get_args(StageKind)) == list(KINDS)
    assert set(get_args(StageSpec.model_fields["kind"].annotation)) == set(KINDS)


def test_each_kind_has_exactly_one_runner():
    from alignflow.flows.stages.runners import RUNNERS

    assert set(RUNNERS) == set(KINDS)
    assert len(set(map(id, RUNNERS.values()))) == len(RUNNERS), "one runner serves two kinds"


def test_records_are_consistent():
    for r in KINDS.values():
        assert r.required <= set(r.inputs), r.name
        assert r.plugins <= {"algorithm", "rewards", "sampler", "selectors", "environment"}, r.name
        assert r.outputs and r.outputs <= {"model", "dataset"}, r.name
        assert not r.rank_dependent or r.data_parallel, f"{r.name}: rank-dependent but not data-parallel"
        assert not r.value_head or r.training, r.name
        assert not r.needs_rewards or "rewards" in r.plugins, r.name
        assert not r.schema_needs_plugins or "algorithm" in r.plugins, r.name
    # an input name reads the same output in every kind that takes it
    reads = {}
    for r in KINDS.values():
        for name, output in r.inputs.items():
            assert reads.setdefault(name, output) == output, f"{name} reads {reads[name]} and {output}"


def test_derived_tables_follow_the_records():
    from alignflow.flows.stages import OUTPUT_OF_INPUT

    assert kinds.TRAINING_KINDS == ("sft", "reward_model", "prm", "preference", "rl")
    assert set(kinds.VALUE_HEAD_KINDS) == {"reward_model", "prm"}
    assert kinds.THREAD_SAFE_KINDS == {"select"}
    assert kinds.RANK_DEPENDENT_KINDS == {"rl"}
    assert kinds.DATA_PARALLEL_KINDS == set(KINDS) - {"select", "critique_revise"}
    assert OUTPUT_OF_INPUT["teacher"] == "model" and OUTPUT_OF_INPUT["eval_dataset"] == "dataset"
    assert "constitution" not in OUTPUT_OF_INPUT  # a file, never a stage's output
    assert kinds.settings_model("rl").__name__ == "RLSettings"


def test_dataset_schema_of_kinds_whose_rows_depend_on_the_stage():
    from alignflow.core.spec.stage import StageSpec

    stage = StageSpec(kind="rejection_sampling", settings={"output": "self_play"})
    assert stage_kind("rejection_sampling").dataset_schema(stage) == "sft"
    assert stage_kind("rejection_sampling").dataset_schema(StageSpec(kind="rejection_sampling")) == "prompt_answer"
    assert stage_kind("critique_revise").dataset_schema(StageSpec(kind="critique_revise")) == "prompt"
    assert stage_kind("prm").dataset_schema(StageSpec(kind="prm")) == "steps"
    assert stage_kind("select").dataset_schema(StageSpec(kind="select")) is None


def test_an_unknown_kind_names_the_known_ones():
    with pytest.raises(SpecError, match=r"unknown stage kind 'ppo': expected one of select, sft, .*evaluate"):
        stage_kind("ppo")


def test_markdown_table_lists_every_kind_once_with_its_settings_model():
    lines = kinds_markdown().splitlines()
    assert lines[0].startswith("| kind | inputs |") and len(lines) == 2 + len(KINDS)
    for name, line in zip(KINDS, lines[2:]):
        assert line.startswith(f"| `{name}` |")
        assert f"`{KINDS[name].settings.__name__}`" in line
    rl = lines[2 + list(KINDS).index("rl")]
    assert "**model**" in rl and "teacher" in rl and "**teacher**" not in rl and rl.endswith("| yes |")
