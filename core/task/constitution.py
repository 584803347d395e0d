"""A constitution (Constitutional AI, Bai et al. 2022, arXiv 2212.08073): principles read from a text file and
drawn by seed for each critique.

The file holds one principle per non-empty line; a line starting with '#' is a comment. Torch-free, so
`alignflow validate` checks the file before any model loads.
"""

from __future__ import annotations

import random
from pathlib import Path

from alignflow.core.errors import DataError

FORMAT = "a text file, one principle per non-empty line; lines starting with '#' are comments"


def read_principles(path: str | Path) -> list[str]:
    """The principles of a constitution file, in order; a missing, non-text or empty file is a DataError
    naming it."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such constitution file (expected {FORMAT})")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: the constitution is not UTF-8 text (byte {exc.start}); expected {FORMAT}") from None
    principles = [line.strip() for line in text.splitlines()]
    principles = [p for p in principles if p and not p.startswith("#")]
    if not principles:
        raise DataError(f"{path}: empty constitution: no principles (expected {FORMAT})")
    return principles


def constitution_problems(path: str | Path) -> list[str]:
    """What is wrong with a constitution file, as preflight reports it: [] or one problem."""
    try:
        read_principles(path)
    except DataError as exc:
        return [str(exc)]
    return []


def draw_principles(principles: list[str], answers: int, rounds: int, seed: int) -> list[list[str]]:
    """For each of `answers` answers, the principle of each of its `rounds` critique/revision rounds: uniform
    draws with replacement from one `random.Random(seed)`, answer by answer (CAI draws a principle per
    critique), so the same seed draws the same principles."""
    rng = random.Random(seed)
    return [[rng.choice(principles) for _ in range(rounds)] for _ in range(answers)]
