"""Worked, step-wise solutions of a few reasoning-gym tasks, from a clean and a sloppy teacher.

A solution is written like the bundled arithmetic task's: space-separated steps in `<think>`, then the
answer, ``<think>3+4=7 7-2=5</think><answer>5</answer>``, so a `step_labels` / `prm` stage with
`step_separator: " "` sees one step per intermediate result. Every step is local and short:

- chain_sum: one operation per step, left to right (``3 + 4 - 2``: ``3+4=7 7-2=5``);
- gcd: Euclid's remainders (``26, 59``: ``59%26=7 26%7=5 7%5=2 5%2=1 2%1=0``), the answer the last divisor;
- spell_backward: the word's letters from the last (``neon``: ``n o e n``), the answer joined;
- letter_counting: each word with its count of the letter (``hundred:1 thousand:1``), the answer the sum;
- count_bits: the largest power of two taken off at each step (``50-32=18 18-16=2 2-2=0``), the answer the
  number of steps.

The sloppy teacher slips once in NOISE of its solutions, at a random step (an arithmetic result off by one, a
letter skipped, a word miscounted), and follows its slip through consistently, as the arithmetic task's
`sft_noisy` teacher drops a carry: a model trained on it samples both right and wrong steps.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable

from alignflow.core.errors import AlignflowError
from alignflow.plugins.reasoning_gym import task_rows

SEPARATOR = " "
NOISE = 0.5  # share of the sloppy teacher's solutions with one slip
# Each task's options: short problems whose text the character tokenizer encodes and a ~1M model can follow.
CONFIGS: dict[str, dict] = {
    "chain_sum": {"min_terms": 2, "max_terms": 4, "min_digits": 1, "max_digits": 1},
    "gcd": {"min_numbers": 2, "max_numbers": 2, "min_value": 1, "max_value": 60},
    "spell_backward": {"min_word_len": 3, "max_word_len": 6},
    "letter_counting": {"min_words": 2, "max_words": 3},
    "count_bits": {"min_n": 1, "max_n": 511},
}
Fault = tuple[int, int]  # (the step that slips, which way: +1 or -1)


def render(steps: list[str], answer: str) -> str:
    return f"<think>{SEPARATOR.join(steps)}</think><answer>{answer}</answer>"


def _chain_sum(meta: dict, fault: Fault | None) -> tuple[list[str], str]:
    """Sums and differences left to right; a slipped result is carried on."""
    tokens = meta["expression"].split()
    values, ops = [int(t) for t in tokens[0::2]], tokens[1::2]
    if len(values) != len(ops) + 1 or any(op not in ("+", "-") for op in ops):
        raise ValueError(f"expression {meta['expression']!r}")
    acc, steps = values[0], []
    for k, (op, v) in enumerate(zip(ops, values[1:])):
        out = (acc + v if op == "+" else acc - v) + (fault[1] if fault and fault[0] == k else 0)
        steps.append(f"{acc}{op}{v}={out}")
        acc = out
    return steps, str(acc)


def _gcd(meta: dict, fault: Fault | None) -> tuple[list[str], str]:
    """Euclid's algorithm, the larger number first; a slipped remainder is carried on."""
    a, b = sorted((int(n) for n in meta["numbers"]), reverse=True)
    if b < 1:
        raise ValueError(f"numbers {meta['numbers']}")
    steps = []
    while True:
        rest = a % b
        if fault is not None and fault[0] == len(steps):
            rest = rest + fault[1] if rest + fault[1] >= 0 else rest + 1
        steps.append(f"{a}%{b}={rest}")
        if rest == 0:
            return steps, str(b)
        a, b = b, rest


def _spell_backward(meta: dict, fault: Fault | None) -> tuple[list[str], str]:
    """The letters from the last; a slip skips one."""
    letters = list(reversed(meta["word"]))
    if fault is not None and len(letters) > 1:
        del letters[fault[0]]
    return letters, "".join(letters)


def _letter_counting(meta: dict, fault: Fault | None) -> tuple[list[str], str]:
    """Each word's count of the letter (case-blind, as the task counts); a slip miscounts one word by one."""
    letter, total, steps = meta["target_letter"], 0, []
    for k, word in enumerate(meta["span"]):
        count = word.lower().count(letter)
        if fault is not None and fault[0] == k:
            count = count + fault[1] if count + fault[1] >= 0 else count + 1
        steps.append(f"{word}:{count}")
        total += count
    return steps, str(total)


def _count_bits(meta: dict, fault: Fault | None) -> tuple[list[str], str]:
    """Take off the largest power of two until nothing is left: one step per 1 bit. A slipped difference is
    carried on, so the count of steps may come out wrong."""
    n, steps = int(meta["number"]), []
    while n > 0:
        power = 1 << (n.bit_length() - 1)
        rest = n - power
        if fault is not None and fault[0] == len(steps):
            rest = rest + fault[1] if rest + fault[1] >= 0 else rest + 1
        steps.append(f"{n}-{power}={rest}")
        n = rest
    return steps, str(len(steps))


WRITERS: dict[str, Callable[[dict, Fault | None], tuple[list[str], str]]] = {
    "chain_sum": _chain_sum,
    "gcd": _gcd,
    "spell_backward": _spell_backward,
    "letter_counting": _letter_counting,
    "count_bits": _count_bits,
}


def worked(task: str, metadata: dict | str, fault: Fault | None = None) -> tuple[list[str], str]:
    """(steps, answer) of task `task`'s problem described by its row's `metadata`; `fault` makes step
    fault[0] slip (fault[1] = +1 / -1 where a result is off by one) and the later steps follow it."""
    if task not in WRITERS:
        raise AlignflowError(f"no worked solutions for reasoning-gym task {task!r} (tasks: {', '.join(WRITERS)})")
    meta = json.loads(metadata) if isinstance(metadata, str) else metadata
    try:
        return WRITERS[task](meta, fault)
    except (KeyError, ValueError, TypeError) as exc:
        raise AlignflowError(f"reasoning-gym task {task!r}: metadata missing or malformed: {exc}") from None


def sloppy_fault(task: str, metadata: dict | str, rng: random.Random) -> Fault | None:
    """The sloppy teacher's slip for one solution: none in 1 - NOISE of them, else a random step and way."""
    if rng.random() >= NOISE:
        return None
    steps, _ = worked(task, metadata)
    return rng.randrange(len(steps)), rng.choice((-1, 1))


def step_rows(tasks: list[str], size: int, seed: int, teacher: str = "clean",
              exclude: set[str] = frozenset()) -> list[dict]:
    """`size` rows of each task (CONFIGS' options) from `seed`, each with a worked `completion` by the clean or
    sloppy teacher, interleaved in a shuffled order fixed by the seed."""
    if teacher not in ("clean", "sloppy"):
        raise AlignflowError(f"teacher {teacher!r}: expected clean or sloppy")
    unknown = [t for t in tasks if t not in WRITERS]
    if unknown or not tasks:
        raise AlignflowError(f"tasks {','.join(unknown) or '(none)'}: expected some of {', '.join(WRITERS)}")
    rng = random.Random(seed)
    rows = []
    for task in tasks:
        for row in task_rows(task, size, seed, CONFIGS[task], exclude):
            fault = sloppy_fault(task, row["metadata"], rng) if teacher == "sloppy" else None
            steps, answer = worked(task, row["metadata"], fault)
            rows.append({**row, "completion": render(steps, answer)})
    rng.shuffle(rows)
    return rows
