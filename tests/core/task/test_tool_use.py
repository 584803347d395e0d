"""The bundled tool-use task: the same bytes for a seed, the teacher's sloppiness, no prompt in two files."""

import json

from alignflow.core.task.tool_use import NOISE, SIZES, write_tool_datasets


def test_files_are_a_function_of_the_seed_and_share_no_prompt(tmp_path):
    a, b = write_tool_datasets(tmp_path / "a"), write_tool_datasets(tmp_path / "b")
    assert all(a[k].read_bytes() == b[k].read_bytes() for k in a)
    rows = {k: [json.loads(line) for line in p.read_text().splitlines()] for k, p in a.items()}
    assert {k: len(v) for k, v in rows.items()} == SIZES
    prompts = {k: {r["messages"][0]["content"] if "messages" in r else r["prompt"] for r in v}
               for k, v in rows.items()}
    assert not (prompts["sft_sloppy"] & prompts["rl"] or prompts["sft_sloppy"] & prompts["test"]
                or prompts["rl"] & prompts["test"])
    for r in rows["test"]:
        x, y = map(int, r["prompt"].rstrip("=").split("*"))
        assert r["answer"] == str(x * y) and 10 <= x < 100 and 10 <= y < 100


def test_the_teacher_guesses_wrong_without_the_tool_and_is_right_with_it(tmp_path):
    rows = [json.loads(line)["messages"] for line in write_tool_datasets(tmp_path)["sft_sloppy"].read_text().splitlines()]
    guesses = [m for m in rows if len(m) == 2]
    assert abs(len(guesses) / len(rows) - NOISE) < 0.03
    for m in rows:
        x, y = map(int, m[0]["content"].rstrip("=").split("*"))
        if len(m) == 2:
            guess = int(m[1]["content"][len("<answer>"): -len("</answer>")])
            assert guess != x * y and len(str(guess)) == len(str(x * y))
        else:
            assert [t["role"] for t in m] == ["user", "assistant", "tool", "assistant"]
            assert m[1]["content"] == f"<call>calculator {x}*{y}</call>" and m[2]["content"] == str(x * y)
            assert m[3]["content"] == f"<answer>{x * y}</answer>"
