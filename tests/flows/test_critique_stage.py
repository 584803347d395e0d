"""The critique_revise stage: which (revision, original) rows are written, the templates and the constitution it
reads, and that a DPO stage trains on what it writes."""

import json
import math
from pathlib import Path

import pytest

import alignflow.plugins.dpo
import alignflow.plugins.hf
from alignflow.core.errors import DataError, SpecError
from alignflow.core.plugins import Plugins
from alignflow.core.spec.settings import CritiqueSettings, TrainSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.preflight import check_pipeline
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.critique import Revised, build_rows, run_critique_revise
from alignflow.flows.stages.preference import run_preference
from helpers.stages import stage_context
from test_rejection_stage import Rewards, even

ROWS = [{"prompt": "p0", "answer": "0"}, {"prompt": "p1", "answer": "1"}]


def handmade(scores=None) -> Revised:
    """Two answers per prompt; answer 1 of p0 is revised into itself."""
    return Revised(prompt_index=[0, 0, 1, 1], original=["a", "b", "c", "d"],
                   principles=[["P1"], ["P2"], ["P1"], ["P2"]], critiques=[["ca"], ["cb"], ["cc"], ["cd"]],
                   revised=["A", "b", "C", "D"], scores=scores)


def test_pairs_drop_revisions_equal_to_their_original_and_keep_the_prompt_columns():
    rows = build_rows(ROWS, handmade(), "pairs")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [("p0", "A", "a"), ("p1", "C", "c"),
                                                                      ("p1", "D", "d")]
    assert rows[0] == {"prompt": "p0", "answer": "0", "chosen": "A", "rejected": "a", "principles": ["P1"],
                       "critiques": ["ca"]}


def test_sft_rows_are_every_final_revision_even_an_unchanged_one():
    rows = build_rows(ROWS, handmade(), "sft")
    assert [(r["prompt"], r["completion"], r["original"]) for r in rows] == [
        ("p0", "A", "a"), ("p0", "b", "b"), ("p1", "C", "c"), ("p1", "D", "d")]


def test_scores_are_written_and_improved_keeps_only_strictly_higher_revisions():
    # (original, revision) totals: a 0 -> A 1 (better), b 1 -> b 1 (equal), c 1 -> C 0 (worse), d 0 -> D 0 (tie)
    revised = handmade(scores=([0.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]))
    every = build_rows(ROWS, revised, "pairs", "all")
    assert [(r["chosen"], r["chosen_score"], r["rejected_score"]) for r in every] == [
        ("A", 1.0, 0.0), ("C", 0.0, 1.0), ("D", 0.0, 0.0)]
    assert [r["chosen"] for r in build_rows(ROWS, revised, "pairs", "improved")] == ["A"]
    sft = build_rows(ROWS, revised, "sft", "improved")
    assert [(r["completion"], r["score"], r["original_score"]) for r in sft] == [("A", 1.0, 0.0)]


@pytest.mark.parametrize("field, template, problem", [
    ("critique_template", "{prompt} {critique}", "unknown field {critique}; expected {prompt}, {completion}, "
                                                 "{principle}"),
    ("revision_template", "{prompt}{answer}", "unknown field {answer}"),
    ("revision_template", "{prompt.upper}", "unknown field {prompt.upper}"),
    ("revision_template", "{}", "unknown field {}"),
    ("critique_template", "{prompt", "not a format string"),
])
def test_templates_name_the_unknown_field(field, template, problem):
    with pytest.raises(ValueError, match=f"{field}\n.*" + problem.replace("{", r"\{").replace("}", r"\}")
                       .replace(".", r"\.")):
        CritiqueSettings(**{field: template})
    assert CritiqueSettings(critique_template="{{x}} {prompt:>4}").critique_template  # escaped braces, a spec


def test_the_default_templates_are_the_cai_requests():
    s = CritiqueSettings()
    fields = {"prompt": "What is 2+2?", "completion": " 5", "principle": "Be correct.", "critique": "It is 4."}
    assert s.critique_template.format(**fields) == (
        "Human: What is 2+2?\n\nAssistant:  5\n\nCritiqueRequest: Identify specific ways in which the assistant's "
        "last response does not follow this principle: Be correct.\n\nCritique:")
    assert s.revision_template.format(**fields).endswith(
        "Critique: It is 4.\n\nRevisionRequest: Please rewrite the assistant response so that it follows this "
        "principle: Be correct.\n\nRevision:")
    assert (s.n, s.revisions, s.output, s.keep) == (1, 1, "pairs", "all")


PRINCIPLES = ["Check every carry.", "Check every borrow.", "Answer in digits."]


@pytest.fixture
def files(tmp_path, tiny_model):
    """`files(prompts=6)`: the tiny model (seed 1), `prompts` prompt rows and the constitution."""
    def make(prompts: int = 6) -> dict:
        data = tmp_path / "prompts.jsonl"
        data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n"
                                for a in range(prompts)))
        constitution = tmp_path / "constitution.txt"
        constitution.write_text("# principles\n" + "\n\n".join(PRINCIPLES) + "\n")
        return {"model": tiny_model(seed=1), "dataset": data, "constitution": constitution}

    return make


def plugins() -> Plugins:
    plugs = Plugins()
    for module in (alignflow.plugins.hf, alignflow.plugins.dpo, Rewards):
        plugs.add(module, getattr(module, "__name__", "rewards"))
    return plugs


def critique_context(tmp_path, inputs, name, rewards=("even_start",), **settings) -> StageContext:
    spec = parse_spec({"name": "cai", "stages": {"cai": {
        "kind": "critique_revise", "inputs": {k: str(v) for k, v in inputs.items()}, "rewards": list(rewards),
        "settings": settings}}}, plugins=plugins())
    return stage_context(tmp_path, spec, settings_model=CritiqueSettings, inputs=inputs, seed=7, plugins=plugins(),
                         work=name, checkpoints=f"ckpt-{name}")


def test_stage_writes_seeded_pairs_that_a_dpo_stage_trains_on(tmp_path, files, one_thread):
    inputs = files()
    settings = {"n": 2, "revisions": 2, "generation": {"max_new_tokens": 6},
                "critique_template": "{prompt}{completion} {principle}\n{prompt}",
                "revision_template": "{prompt}{completion} {critique}\n{prompt}"}
    result = run_critique_revise(critique_context(tmp_path, inputs, "a", **settings))
    text = result.outputs["dataset"].read_text()
    assert text == run_critique_revise(critique_context(tmp_path, inputs, "b", **settings)).outputs[
        "dataset"].read_text()  # seeded: the answers, principles, critiques and revisions
    rows = [json.loads(line) for line in text.splitlines()]
    m = result.metrics
    assert (m["prompts"], m["answers"], m["rows_written"]) == (6, 12, len(rows))
    # the untrained model's 6-token texts never repeat: every answer is revised, and every pair is written
    assert m["revised_share"] == 1.0 and len(rows) == 12
    for r in rows:
        assert r["chosen"] != r["rejected"] and r["prompt"].endswith("=") and r["answer"]
        assert len(r["principles"]) == len(r["critiques"]) == 2 and set(r["principles"]) <= set(PRINCIPLES)
        assert (r["chosen_score"], r["rejected_score"]) == (float(even(r["chosen"])), float(even(r["rejected"])))
    assert m["improved_share"] == pytest.approx(sum(r["chosen_score"] > r["rejected_score"] for r in rows) / 12)
    assert m["worse_share"] == pytest.approx(sum(r["chosen_score"] < r["rejected_score"] for r in rows) / 12)
    assert m["accuracy/original"] == m["score/original"] == pytest.approx(sum(r["rejected_score"] for r in rows) / 12)
    assert 0 < m["critique_length/mean"] <= 6

    # DPO reads the pairs; its first loss is log 2 (policy = reference: every margin is 0)
    logged = []
    spec = parse_spec({"name": "p", "stages": {"dpo": {
        "kind": "preference", "inputs": {"model": str(inputs["model"]), "dataset": str(result.outputs["dataset"])},
        "algorithm": "dpo", "settings": {"lr": 1e-3, "max_steps": 1, "batch_size": 4, "micro_batch_size": 2,
                                         "max_length": 64, "log_every": 1}}}}, plugins=plugins())
    run_preference(stage_context(tmp_path, spec, settings_model=TrainSettings, plugins=plugins(), work="dpo",
                                 inputs={"model": inputs["model"], "dataset": result.outputs["dataset"]},
                                 checkpoints="ckpt-dpo", log_metrics=lambda metrics, step: logged.append(metrics)))
    assert next(x for x in logged if "loss" in x)["loss"] == pytest.approx(math.log(2), abs=1e-5)


def test_improved_keeps_only_revisions_the_reward_scores_higher(tmp_path, files, one_thread):
    inputs = files(prompts=8)
    result = run_critique_revise(critique_context(tmp_path, inputs, "a", n=2, keep="improved", output="sft",
                                                  generation={"max_new_tokens": 4}))
    rows = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    assert len(rows) == result.metrics["improved_share"] * 16 > 0
    assert all(even(r["completion"]) and not even(r["original"]) for r in rows)
    assert all((r["score"], r["original_score"]) == (1.0, 0.0) for r in rows)


def test_without_rewards_prompts_alone_do_and_rows_carry_no_scores(tmp_path, files, one_thread):
    inputs = files(prompts=3)
    inputs["dataset"].write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(3)))
    result = run_critique_revise(critique_context(tmp_path, inputs, "a", rewards=(), output="sft",
                                                  generation={"max_new_tokens": 4}))
    rows = [json.loads(line) for line in result.outputs["dataset"].read_text().splitlines()]
    assert [sorted(r) for r in rows] == [["completion", "critiques", "original", "principles", "prompt"]] * 3
    assert result.metrics["rows_written"] == 3 and "improved_share" not in result.metrics


def test_improved_without_rewards_and_a_bad_constitution_fail_before_any_sampling(tmp_path, files):
    inputs = files()
    with pytest.raises(SpecError, match="stage 'cai', settings.keep: 'improved' compares the rewards' scores"):
        run_critique_revise(critique_context(tmp_path, inputs, "a", rewards=(), keep="improved"))
    inputs["constitution"].write_text("# nothing yet\n")
    with pytest.raises(DataError, match=f"{inputs['constitution']}: empty constitution"):
        run_critique_revise(critique_context(tmp_path, inputs, "b"))


PIPELINE = """
name: cai
stages:
  critique:
    kind: critique_revise
    inputs: {model: ./base, dataset: prompts.jsonl, constitution: constitution.txt}
    rewards: [math_accuracy]
    settings: {keep: improved}
  dpo:
    kind: preference
    inputs: {model: ./base, dataset: "stage:critique"}
    algorithm: dpo
  rows:
    kind: select
    inputs: {dataset: prompts.jsonl}
    selectors: [dedup]
"""


def test_preflight_checks_the_constitution_and_the_prompt_rows(tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "p.yaml").write_text(PIPELINE)
    (tmp_path / "constitution.txt").write_text("Check every carry.\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    assert list(check_pipeline(tmp_path / "p.yaml", [], tmp_path).stages) == ["critique", "dpo", "rows"]

    (tmp_path / "constitution.txt").write_text("# to do\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "1+1="}\n')  # math_accuracy reads an answer
    with pytest.raises(SpecError) as info:
        check_pipeline(tmp_path / "p.yaml", [], tmp_path)
    msg = str(info.value)
    assert "2 problems found before any compute" in msg
    assert f"stage 'critique', inputs.constitution: {tmp_path / 'constitution.txt'}: empty constitution" in msg
    assert f"stage 'critique', inputs.dataset: {tmp_path / 'prompts.jsonl'}:1: field 'answer': missing" in msg
    # without rewards, prompts alone will do
    (tmp_path / "constitution.txt").write_text("Check every carry.\n")
    check_pipeline(tmp_path / "p.yaml", ["critique.rewards=[]", "critique.settings.keep=all"], tmp_path)
    with pytest.raises(SpecError, match="inputs.constitution: 'stage:rows': expected a text file of principles"):
        check_pipeline(tmp_path / "p.yaml", ["critique.inputs.constitution=stage:rows"], tmp_path)
    (tmp_path / "constitution.txt").unlink()
    with pytest.raises(SpecError, match="inputs.constitution: input 'constitution.txt': no such file|"
                                        "no such constitution file"):
        check_pipeline(tmp_path / "p.yaml", [], tmp_path)


def test_a_stage_without_rewards_still_names_its_sampler():
    """The stage generates whether or not it lists rewards: its sampler (and so the sampler's code in its
    digest) is filled in either way, as for the kinds that need rewards."""
    spec = parse_spec({"name": "cai", "stages": {"cai": {
        "kind": "critique_revise", "inputs": {"model": "m", "dataset": "d.jsonl", "constitution": "c.txt"}}}})
    assert spec.stages["cai"].sampler.name == "hf"
