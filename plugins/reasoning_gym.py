"""reasoning-gym tasks: rows of any of its procedural tasks by name, and the `reasoning_gym` reward, which
scores an answer with the task's own verifier (`score_answer`).

Rows are generated from a seed (`alignflow data reasoning-gym TASK --size N --seed S`), so the same
command writes the same bytes; each row keeps the task's `metadata` (as JSON text: its shape differs by
task) that its verifier reads. The library is imported only when used: `pip install reasoning-gym`.
"""

from __future__ import annotations

import json
from typing import Any

from alignflow.core import hookimpl
from alignflow.core.errors import AlignflowError
from alignflow.plugins.math_accuracy import extract_answer

DISTRIBUTION = "reasoning-gym"


def library():
    try:
        import reasoning_gym
    except ImportError:
        raise AlignflowError("reasoning-gym tasks need the library: pip install reasoning-gym") from None
    return reasoning_gym


def task_rows(task: str, size: int, seed: int, config: dict[str, Any] | None = None,
              exclude: set[str] = frozenset()) -> list[dict]:
    """`size` rows of task `task` generated from `seed`: prompt (the question), answer, completion (the answer
    in `<answer>` tags, for sft), task, and the metadata its verifier reads. Rows whose prompt is in `exclude`
    (a training set's, for a test set) are skipped and generation goes on.

    reasoning-gym draws row i from seed + i: row sets from seeds closer than their size share rows.
    """
    rg = library()
    rows, start = [], seed
    while len(rows) < size:
        want = size - len(rows)
        try:
            dataset = rg.create_dataset(task, size=want, seed=start, **(config or {}))
        except (KeyError, ValueError, TypeError) as exc:
            known = ", ".join(sorted(rg.factory.DATASETS))
            raise AlignflowError(f"reasoning-gym task {task!r}: {exc} (tasks: {known})") from None
        rows += [_row(task, e) for e in dataset if e["question"] not in exclude]
        start += want  # the next rows of the same stream
        if start - seed > 100 * size:
            raise AlignflowError(f"reasoning-gym task {task!r}: fewer than {size} rows outside the excluded ones")
    return rows


def _row(task: str, entry: dict) -> dict:
    return {"prompt": entry["question"], "answer": str(entry["answer"]),
            "completion": f"<answer>{entry['answer']}</answer>", "task": task,
            "metadata": json.dumps(entry["metadata"], sort_keys=True, default=str)}


def reasoning_gym(prompts: list[str], completions: list[str], answer: list, task: list[str], metadata: list,
                  **columns) -> list[float | None]:
    """The task's own `score_answer` of the `<answer>` (else the whole completion), in [0, 1]."""
    rg = library()
    scores: list[float | None] = []
    for prompt, completion, gold, name, meta in zip(prompts, completions, answer, task, metadata, strict=True):
        entry = {"question": prompt, "answer": gold,
                 "metadata": json.loads(meta) if isinstance(meta, str) else meta}
        pred = extract_answer(completion)
        scores.append(float(rg.get_score_answer_fn(name)(pred if pred is not None else completion.strip(), entry)))
    return scores


reasoning_gym.libraries = (DISTRIBUTION,)  # its version enters the digest of a stage scored with it


@hookimpl
def register_rewards(register):
    register("reasoning_gym", reasoning_gym)
