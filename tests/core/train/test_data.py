import json

import pytest
import torch

from alignflow.core.train.batching import collate, flat_tensor, pad
from alignflow.core.train.datasets import (
    IGNORE_INDEX, check_row, load_rows, read_rows, split_messages, tokenize, truncate,
)
from alignflow.core.spec.kinds import ranked_file
from alignflow.core.train.steps import split_steps, step_sequence, step_spans
from alignflow.core.errors import DataError
from alignflow.core.task.tokenizer import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def _load(tmp_path, rows, schema, name="d.jsonl"):
    return load_rows(_write(tmp_path / name, rows), schema, cache_dir=str(tmp_path / "cache"))


GOOD = {"prompt": "1+2=", "completion": "<answer>3</answer>"}


def test_missing_field_names_file_row_and_field(tmp_path):
    with pytest.raises(DataError, match=r"d\.jsonl:2: field 'completion': missing"):
        _load(tmp_path, [GOOD, {"prompt": "1+1="}], "sft")


def test_wrong_type_reads_expected_and_got(tmp_path):
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "2+2=", "answer": 4}]
    with pytest.raises(DataError) as err:
        _load(tmp_path, rows, "prompt_answer")
    assert str(err.value) == f"{tmp_path / 'd.jsonl'}:2: field 'answer': expected str, got int"


def test_invalid_json_line_at_row_3(tmp_path):
    with pytest.raises(DataError, match=r"d\.jsonl:3: invalid JSON"):
        _load(tmp_path, [GOOD, GOOD, '{"prompt": "1+2=", "completion": '], "sft")


def test_blank_lines_keep_line_numbers(tmp_path):
    with pytest.raises(DataError, match=r"d\.jsonl:4: field 'label': expected bool, got int"):
        _load(tmp_path, [dict(GOOD, label=True), "", "", dict(GOOD, label=1)], "unpaired")


def test_empty_file_is_an_error_naming_it(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"empty\.jsonl: empty dataset"):
        load_rows(tmp_path / "empty.jsonl", "sft")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        load_rows(tmp_path / "missing.jsonl", "sft")


def test_read_rows_gives_load_rows_rows_and_errors_without_datasets(tmp_path):
    """The list `load_rows(...).to_list()` gives (a row's missing keys None, order kept), and its errors."""
    rows = [{"prompt": "1+2=", "answer": "3", "id": 7}, {"answer": "4", "prompt": "2+2="},
            {"prompt": "3+3=", "answer": "6", "note": "x"}]
    path = _write(tmp_path / "d.jsonl", rows)
    assert read_rows(path, "prompt_answer") == load_rows(path, "prompt_answer", cache_dir=str(tmp_path)).to_list()
    assert read_rows(path, "prompt_answer")[1] == {"prompt": "2+2=", "answer": "4", "id": None, "note": None}
    _write(path, rows + [{"prompt": "1+1="}])
    with pytest.raises(DataError, match=r"d\.jsonl:4: field 'answer': missing"):
        read_rows(path, "prompt_answer")
    with pytest.raises(DataError, match=r"missing\.jsonl: no such file"):
        read_rows(tmp_path / "missing.jsonl", "prompt_answer")


def test_row_checks_for_every_schema():
    assert check_row({"prompt": "p", "chosen": "a", "rejected": "b"}, "pairwise") is None
    assert check_row({"messages": [{"role": "user", "content": "hi"}]}, "sft") is None
    assert "item 0: expected {role: str, content: str}" in check_row({"messages": [{"role": "user"}]}, "sft")
    steps = {"prompt": "p", "steps": ["a", "b"], "step_labels": [1, True]}
    assert check_row(steps, "steps") is None
    assert check_row(dict(steps, steps=["a", 2]), "steps") == "field 'steps': item 1: expected str, got int"
    assert check_row(dict(steps, step_labels=[1]), "steps") == "field 'step_labels': 1 labels for 2 steps"
    assert check_row(dict(steps, step_labels="11"), "steps").endswith("expected list[int|bool|float], got str")
    assert check_row(dict(steps, step_labels=[0.25, 1]), "steps") is None  # Math-Shepherd's soft labels
    assert check_row(dict(steps, step_labels=[1, 2]), "steps") == \
        "field 'step_labels': item 1: expected a label in [0, 1], got 2"
    assert check_row(["a"], "sft") == "expected a JSON object, got list"
    assert check_row({"prompt": None, "answer": "1"}, "prompt_answer").endswith("got null")


def test_parquet_rows_are_validated(tmp_path):
    from datasets import Dataset

    Dataset.from_list([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": None}]).to_parquet(
        tmp_path / "d.parquet")
    with pytest.raises(DataError, match=r"d\.parquet:2: field 'answer': expected str, got null"):
        load_rows(tmp_path / "d.parquet", "prompt_answer", cache_dir=str(tmp_path / "cache"))


def test_prompt_masking_puts_ignore_exactly_on_prompt_tokens(tmp_path, tok):
    ds = _load(tmp_path, [GOOD, {"prompt": "12*3=", "completion": "36"}], "sft")
    out, stats = tokenize(ds, tok, max_length=64)
    assert stats == {"rows": 2, "truncated": 0, "dropped": 0}
    row = out[1]
    assert row["input_ids"] == tok("12*3=36").input_ids + [tok.eos_token_id]
    assert row["labels"] == [IGNORE_INDEX] * 5 + row["input_ids"][5:]
    # The tag tokens count as one each: 4 prompt chars, then <answer> 3 </answer> EOS.
    assert out[0]["labels"][:4] == [IGNORE_INDEX] * 4 and len(out[0]["labels"]) == 8


def test_chat_rows_mask_everything_but_the_last_assistant_turn(tmp_path, tok):
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "1+2="},
             {"role": "assistant", "content": "3"}]
    assert split_messages(tok, convo) == ("S\n1+2=", "3</s>")
    out, _ = tokenize(_load(tmp_path, [{"messages": convo}], "sft"), tok, max_length=64)
    labels = out[0]["labels"]
    assert labels.count(IGNORE_INDEX) == 6 and labels[6:] == [tok.convert_tokens_to_ids("3"), tok.eos_token_id]


def test_multi_turn_chat_rows_learn_every_assistant_turn_and_no_tool_result(tmp_path, tok):
    """A transcript with several assistant turns: each turn's tokens and its EOS are labelled, the tool result
    between them (in the tag form the tiny template implies) is context, and the ids are those an episode
    of the same conversation is built from."""
    convo = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "<call>calculator 12*34</call>"},
             {"role": "tool", "content": "408"}, {"role": "assistant", "content": "<answer>408</answer>"}]
    out, stats = tokenize(_load(tmp_path, [{"messages": convo}], "sft"), tok, max_length=128)
    ids, labels = out[0]["input_ids"], out[0]["labels"]
    assert tok.decode(ids) == "12*34=<call>calculator 12*34</call></s><result>408</result><answer>408</answer></s>"
    learned = [t for t, label in zip(ids, labels) if label != IGNORE_INDEX]
    assert learned == [t for t, label in zip(ids, labels) if label == t]  # labels are the ids themselves
    assert tok.decode(learned) == "<call>calculator 12*34</call></s><answer>408</answer></s>"
    # cut inside the second turn: still kept (the first turn is labelled), counted as truncated
    out, stats = tokenize(_load(tmp_path, [{"messages": convo}], "sft", "b.jsonl"), tok, max_length=40)
    assert stats == {"rows": 1, "truncated": 1, "dropped": 0} and len(out[0]["input_ids"]) == 40


# a template that writes the tools' schemas before the conversation, as Qwen's and Llama's do
TOOLS_TEMPLATE = (
    "{%- if tools -%}{{ '[tools]' + (tools | tojson) + '\n' }}{%- endif -%}"
    "{%- for m in messages -%}{{ '[' + m.role + ']' + m.content + eos_token }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '[assistant]' }}{%- endif -%}")
TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate.",
                                           "parameters": {"type": "object", "properties": {
                                               "expression": {"type": "string"}}, "required": ["expression"]}}},
         {"type": "function", "function": {"name": "python", "description": "Run.",
                                           "parameters": {"type": "object", "properties": {
                                               "code": {"type": "string"}}, "required": ["code"]}}}]


@pytest.mark.parametrize("as_string", [False, True])
def test_a_chat_rows_tools_are_rendered_as_the_episode_renders_them(tmp_path, as_string):
    """A `tools` column (a list, or a JSON string of one) puts the schemas where the template wants them, as an
    episode with those tools renders them: the nulls Arrow adds to unite the two schemas' fields are dropped."""
    from alignflow.core.environments.chat import Transcript

    tok = build_char_tokenizer(1024)
    tok.chat_template = TOOLS_TEMPLATE
    convo = [{"role": "user", "content": "12*34="}, {"role": "assistant", "content": "<answer>408</answer>"}]
    tools = json.dumps(TOOLS) if as_string else TOOLS
    out, _ = tokenize(_load(tmp_path, [{"messages": convo, "tools": tools}], "sft"), tok, max_length=1024)
    ids, labels = out[0]["input_ids"], out[0]["labels"]
    prompt = Transcript(tok, convo[:1], TOOLS).prompt_ids
    assert ids[:len(prompt)] == prompt and all(x == IGNORE_INDEX for x in labels[:len(prompt)])
    assert "calculator" in tok.decode(prompt) and "null" not in tok.decode(prompt)
    assert tok.decode([t for t in labels if t != IGNORE_INDEX]) == "<answer>408</answer></s>"


def test_a_bad_tools_column_names_the_row(tmp_path):
    convo = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]
    with pytest.raises(DataError, match=r"d\.jsonl:2: field 'tools': expected a list of JSON function schemas"):
        _load(tmp_path, [{"messages": convo}, {"messages": convo, "tools": "[calculator"}], "sft")


def test_truncation_counts_and_policy(tmp_path, tok):
    rows = [{"prompt": "1+2=", "completion": "3"},  # 4 + 2 tokens: fits
            {"prompt": "12+34=", "completion": "46464646"},  # 6 + 9: completion cut
            {"prompt": "1234567+1=", "completion": "8"}]  # 10-token prompt: dropped
    out, stats = tokenize(_load(tmp_path, rows, "sft"), tok, max_length=10)
    assert stats == {"rows": 3, "truncated": 1, "dropped": 1}
    assert len(out) == 2 and [len(r) for r in out["input_ids"]] == [6, 10]
    assert tok.eos_token_id not in out[1]["input_ids"]  # a cut completion must not learn to stop
    assert truncate([1, 2], [3, 4, 5], 4) == ([1, 2, 3, 4], [IGNORE_INDEX] * 2 + [3, 4], 1)


def test_tokenize_is_cached_by_fingerprint(tmp_path, tok):
    ds = _load(tmp_path, [GOOD] * 3, "sft")
    a, _ = tokenize(ds, tok, max_length=32)
    b, _ = tokenize(ds, tok, max_length=32)
    c, _ = tokenize(ds, tok, max_length=16)
    assert a._fingerprint == b._fingerprint != c._fingerprint
    assert a.cache_files and a.cache_files == b.cache_files


def test_pairwise_unpaired_and_steps(tmp_path, tok):
    pairs = _load(tmp_path, [{"prompt": "1+2=", "chosen": "3", "rejected": "45"}], "pairwise", "p.jsonl")
    row = tokenize(pairs, tok, 64, "pairwise")[0][0]
    assert row["chosen_labels"] == [IGNORE_INDEX] * 4 + row["chosen_input_ids"][4:]
    assert len(row["rejected_input_ids"]) == 7
    unpaired = _load(tmp_path, [dict(GOOD, label=False)], "unpaired", "u.jsonl")
    assert tokenize(unpaired, tok, 64, "unpaired")[0][0]["label"] is False
    steps = _load(tmp_path, [{"prompt": "9+5=", "steps": ["9+5=14", "0+0=1"], "step_labels": [True, False]}],
                  "steps", "s.jsonl")
    row = tokenize(steps, tok, 64, "steps", step_separator=" ")[0][0]
    assert tok.decode(row["input_ids"]) == "9+5=9+5=14 0+0=1 "
    assert [(i, v) for i, v in enumerate(row["labels"]) if v != IGNORE_INDEX] == [(10, 1), (16, 0)]


def test_ranked_rows_are_checked_row_by_row_and_their_lists_have_one_length(tmp_path, tok):
    row = {"prompt": "1+2=", "completions": ["3", "4", "45"], "scores": [1.0, 0, 0]}
    assert check_row(row, "ranked") is None and check_row(dict(row, scores=None), "ranked") is None
    assert check_row(dict(row, completions=["3"], scores=[1]), "ranked") == \
        "field 'completions': expected a list of at least 2 completions, got 1"
    assert check_row(dict(row, scores=[1, 0]), "ranked") == "field 'scores': 2 scores for 3 completions"
    assert check_row(dict(row, scores=[0, 1, 0]), "ranked").startswith("field 'scores': expected the completions "
                                                                        "best first (non-increasing scores)")
    ds = _load(tmp_path, [row], "ranked", "r.jsonl")
    out = tokenize(ds, tok, 64, "ranked")[0][0]
    assert [tok.decode(out[f"candidate{k}_input_ids"][4:], skip_special_tokens=True) for k in range(3)] == \
        ["3", "4", "45"]
    assert out["candidate2_labels"][:4] == [IGNORE_INDEX] * 4 and out["scores"] == [1.0, 0.0, 0.0]
    assert ranked_file(tmp_path / "r.jsonl") and not ranked_file(tmp_path / "nothing.jsonl")
    uneven = _load(tmp_path, [row, dict(row, completions=["3", "5"], scores=[1, 0])], "ranked", "u.jsonl")
    with pytest.raises(DataError, match=r"u\.jsonl: row 2: 2 completions, but row 1 has 3"):
        tokenize(uneven, tok, 64, "ranked", source=str(tmp_path / "u.jsonl"))
    some = _load(tmp_path, [row, {"prompt": "1+1=", "completions": ["2", "3", "4"]}], "ranked", "s.jsonl")
    with pytest.raises(DataError, match=r"s\.jsonl: row 2: no 'scores'"):
        tokenize(some, tok, 64, "ranked", source=str(tmp_path / "s.jsonl"))


def test_split_steps_and_step_sequence(tok):
    assert split_steps("<think>1+2=3 4+5=9</think>", " ") == ["<think>1+2=3", "4+5=9</think>"]
    assert split_steps("a\n\nb\n", "\n") == ["a", "b"]  # empty steps dropped
    assert split_steps("", "\n") == []
    # where each step ends in the completion, for mapping step scores to tokens
    assert step_spans("ab\n\ncd\ne", "\n") == [("ab", 2), ("cd", 6), ("e", 8)]
    ids, ends = step_sequence([7, 8], [[1, 2, 3], [4, 5]])
    assert ids == [7, 8, 1, 2, 3, 4, 5] and ends == [4, 6]


@pytest.mark.parametrize("items", [[3, -1, 7], [0.0, 0.25, -1.5e-9], [0, 0.5], [1.5, 2], [True, False], [],
                                   [0.1, float("nan")]])
def test_flat_tensor_is_torch_tensor_through_a_buffer(items):
    """The same dtype (int64; the default float dtype, also for floats among ints; bool) and the same values."""
    fast, plain = flat_tensor(items), torch.tensor(items)
    assert fast.dtype == plain.dtype and fast.shape == plain.shape
    if fast.is_floating_point():
        fast, plain = fast.nan_to_num(7.0), plain.nan_to_num(7.0)
    assert torch.equal(fast, plain)


@pytest.mark.parametrize("items", [[2 ** 70], [1, "a"]])
def test_flat_tensor_raises_what_torch_tensor_raises(items):
    with pytest.raises(Exception) as plain:
        torch.tensor(items)
    with pytest.raises(type(plain.value)):
        flat_tensor(items)


def test_collate_pads_to_longest_in_micro_batch_only(tok):
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "label": True},
            {"input_ids": [8], "labels": [8], "label": False}]
    right = collate(rows, pad_token_id=0)
    assert right["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert right["labels"].tolist() == [[-100, 6, 7], [8, -100, -100]]
    assert right["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert right["label"].tolist() == [True, False]
    left = collate(rows, pad_token_id=0, padding_side="left")
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    pairs = collate([{"chosen_input_ids": [1, 2], "prompt": "a"}], pad_token_id=0)
    assert pairs["chosen_attention_mask"].tolist() == [[1, 1]] and pairs["prompt"] == ["a"]
    assert pad([[1], [1, 2]], 9).shape == torch.Size([2, 2])
