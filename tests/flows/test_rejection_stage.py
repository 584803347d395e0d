"""The rejection_sampling stage: which completions become SFT rows or preference pairs, and the metrics."""

import json

import pytest

import alignflow.plugins.hf
from alignflow.core import hookimpl
from alignflow.core.plugins import Plugins
from alignflow.core.rewards import RewardOutput
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import SampleSettings
from alignflow.core.spec.schema import parse_spec
from alignflow.flows.stages.rejection import run_rejection_sampling, select_rows
from alignflow.flows.stages.scoring import Scored
from helpers.stages import stage_context
from recording import Samplers, record


def handmade(texts: list[list[str]], totals: list[list[float]], correct: list[list[bool]]) -> Scored:
    rows = [{"prompt": f"p{i}", "answer": str(i)} for i in range(len(texts))]
    index = [i for i, group in enumerate(texts) for _ in group]
    flat = [t for group in texts for t in group]
    generation = Generation(index, [[0]] * len(flat), flat, [False] * len(flat))
    total = [v for group in totals for v in group]
    return Scored(rows, len(texts[0]), generation, RewardOutput(total, {}), [c for g in correct for c in g])


# p0: the best sample is correct; p1: none is; p2: the best is incorrect (say, a format bonus);
# p3: correct samples tie, so the first of them wins, and so does the first of tied incorrect ones.
CASE = handmade(
    [["a", "b", "c"], ["d", "e", "f"], ["g", "h", "i"], ["j", "k", "l"]],
    [[1.0, 0.0, 1.5], [0.0, 0.2, 0.0], [1.0, 2.0, 0.5], [0.0, 1.0, 1.0]],
    [[True, False, True], [False, False, False], [True, False, False], [False, True, True]],
)


def test_sft_rows_are_the_best_sample_when_it_is_correct():
    rows = select_rows(CASE, "sft")
    assert [(r["prompt"], r["completion"], r["reward"]) for r in rows] == [("p0", "c", 1.5), ("p3", "k", 1.0)]
    assert rows[0]["answer"] == "0"  # the prompt's other columns are kept


def test_an_episodes_sft_row_is_its_conversation_with_the_tools_it_was_shown():
    import dataclasses

    schema = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object"}}}]
    episodes = {"messages": [[{"role": "user", "content": f"q{j}"}, {"role": "assistant", "content": t}]
                             for j, t in enumerate(CASE.generation.texts)]}
    shown = lambda tools: dataclasses.replace(  # noqa: E731
        CASE, generation=dataclasses.replace(CASE.generation, episodes=episodes, tools=tools))
    rows = select_rows(shown(schema), "sft")
    assert [r["messages"][1]["content"] for r in rows] == ["c", "k"] and "prompt" not in rows[0]
    assert [json.loads(r["tools"]) for r in rows] == [schema, schema]  # the batch's tools, on every row
    assert rows[0]["answer"] == "0" and rows[0]["reward"] == 1.5
    for none in ([], None):  # episodes shown no tools: no tools column
        assert all("tools" not in r for r in select_rows(shown(none), "sft"))


def test_pairs_are_the_best_correct_against_the_best_incorrect():
    rows = select_rows(CASE, "pairs")
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [
        ("p0", "c", "b"), ("p2", "g", "h"), ("p3", "k", "j")]


def test_lists_are_the_best_correct_then_distinct_lower_scoring_samples_best_first():
    # p0: c (1.5) wins; a (1.0, also correct) and b (0.0) score lower. p2: g (1.0) wins; only i (0.5) is lower
    # (h scores 2.0). p3: k and l tie at 1.0, k is first; only j (0.0) is lower. p1 has no correct sample.
    rows = select_rows(CASE, "lists", list_size=3)
    assert [(r["prompt"], r["completions"], r["scores"]) for r in rows] == [("p0", ["c", "a", "b"], [1.5, 1.0, 0.0])]
    rows = select_rows(CASE, "lists", list_size=2)
    assert [(r["prompt"], r["completions"]) for r in rows] == [
        ("p0", ["c", "a"]), ("p2", ["g", "i"]), ("p3", ["k", "j"])]
    assert rows[0]["answer"] == "0"


def test_self_play_pairs_the_data_completion_against_the_first_sample_that_differs_from_it():
    case = handmade([["a", "b"], ["c", "d"], ["e", "e"]], [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]],
                    [[True, False], [False, True], [True, True]])
    for row, target in zip(case.rows, ["a", "x", "e"]):
        row["completion"] = target
    rows = select_rows(case, "self_play")
    # p0: "a" is the data's own text, so "b"; p1: the first sample, whatever its reward; p2: no sample differs
    assert [(r["prompt"], r["chosen"], r["rejected"]) for r in rows] == [("p0", "a", "b"), ("p1", "x", "c")]
    assert "completion" not in rows[0] and rows[1]["rejected_reward"] == 0.0


def test_more_pairs_per_prompt_take_distinct_incorrect_texts_best_first():
    case = handmade([["a", "x", "y", "x", "z"]], [[1.0, 0.0, 0.5, 0.9, 0.0]], [[True, False, False, False, False]])
    pairs = lambda k: [(r["chosen"], r["rejected"]) for r in select_rows(case, "pairs", k)]  # noqa: E731
    # incorrect by reward: x (0.9, the second x), y (0.5), x (0.0, a repeat), z (0.0)
    assert pairs(1) == [("a", "x")]
    assert pairs(2) == [("a", "x"), ("a", "y")]
    assert pairs(5) == [("a", "x"), ("a", "y"), ("a", "z")]
    assert select_rows(case, "pairs", 5)[0]["rejected_reward"] == 0.9


def even_start(prompts, completions, **_):
    """1 when a completion starts with a character of even code: a coin flip the test can recount."""
    record(f"score {len(completions)}")
    return [float(even(c)) for c in completions]


def even(text: str) -> bool:
    return bool(text) and ord(text[0]) % 2 == 0


class Rewards:
    @staticmethod
    @hookimpl
    def register_rewards(register):
        register("even_start", even_start)


def rs_context(tmp_path, model, prompts: int, sampler: str = "hf", **settings):
    """A function of a folder name: a rejection_sampling context on the tiny model, `prompts` prompts."""
    plugs = Plugins()
    plugs.add(alignflow.plugins.hf, "hf")
    plugs.add(Samplers, "samplers")
    plugs.add(Rewards, "rewards")
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a), "completion": f"{2 * a}"}) + "\n"
                            for a in range(prompts)))
    inputs = {"model": model, "dataset": data}
    spec = parse_spec({"name": "rs", "stages": {"rs": {
        "kind": "rejection_sampling", "inputs": {k: str(v) for k, v in inputs.items()}, "rewards": ["even_start"],
        "sampler": sampler, "settings": settings}}}, plugins=plugs)

    def context(name):
        return stage_context(tmp_path, spec, settings_model=SampleSettings, inputs=inputs, seed=7, plugins=plugs,
                             work=name, checkpoints=f"ckpt-{name}")

    return context


@pytest.mark.parametrize("output", ["sft", "pairs", "self_play"])
def test_stage_writes_rows_that_match_its_samples_and_metrics(tmp_path, output, tiny_model):
    context = rs_context(tmp_path, tiny_model(seed=1), 6, n=4, output=output, generation={"max_new_tokens": 6})

    def run(name):
        return run_rejection_sampling(context(name))

    result = run("a")
    text = result.outputs["dataset"].read_text()
    assert text == run("b").outputs["dataset"].read_text()  # seeded
    rows = [json.loads(line) for line in text.splitlines()]
    m = result.metrics
    assert m["rows_written"] == len(rows) > 0
    if output == "sft":
        assert all(even(r["completion"]) and r["reward"] == 1.0 for r in rows)
        assert m["pass_at_4"] == pytest.approx(len(rows) / 6)  # a row for each prompt with a correct sample
    elif output == "pairs":
        assert all(even(r["chosen"]) and not even(r["rejected"]) for r in rows)
        assert m["pair_share"] == pytest.approx(len(rows) / 6)
    else:  # the untrained model never writes the data's answer: a pair for every prompt
        assert [(r["prompt"], r["chosen"]) for r in rows] == [(f"{a}+{a}=", f"{2 * a}") for a in range(6)]
        assert all(r["rejected"] != r["chosen"] for r in rows)
    assert 0 < m["accuracy"] < 1


@pytest.mark.system
def test_two_ranks_sample_what_one_process_does(tmp_path, monkeypatch, tiny_model):
    """130 prompts are three seeded chunks of 64: rank 0 samples and scores chunks 0 and 2, rank 1 chunk 1,
    and both then hold all of them, so the rows written (by rank 0 alone) are one process's, byte for byte."""
    from alignflow.flows.launch.ranks import run_in_processes

    context = rs_context(tmp_path, tiny_model(seed=1), 130, "counting_hf", n=2, output="pairs",
                         generation={"max_new_tokens": 4})
    results, calls = {}, {}
    for ranks in (1, 2):
        monkeypatch.setenv("CALLS_FILE", str(tmp_path / f"calls{ranks}"))
        results[ranks] = run_in_processes("rejection_sampling", context(f"ranks{ranks}"), threads=1, ranks=ranks)
        calls[ranks] = sorted((tmp_path / f"calls{ranks}").read_text().splitlines())
    assert calls == {1: ["0 generate 2", "0 generate 64", "0 generate 64", "0 score 260"],
                     2: ["0 generate 2", "0 generate 64", "0 score 128", "0 score 4", "1 generate 64", "1 score 128"]}
    one, two = results[1], results[2]
    assert one.metrics == two.metrics and one.metrics["prompts"] == 130 and one.metrics["rows_written"] > 0
    assert two.outputs["dataset"].read_bytes() == one.outputs["dataset"].read_bytes()
