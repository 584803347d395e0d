"""Solutions as steps: the text between separators, where each step ends in text and in tokens, and the
sequence a process reward model reads a score from at each step's last token."""

from __future__ import annotations


def step_spans(completion: str, separator: str) -> list[tuple[str, int]]:
    """A solution's steps, the text between separators (empty steps dropped), with where each ends."""
    spans, start = [], 0
    for step in completion.split(separator):
        if step.strip():
            spans.append((step, start + len(step)))
        start += len(step) + len(separator)
    return spans


def token_ends(decode, ids: list[int], char_ends: list[int]) -> list[int]:
    """For each character offset in `decode(ids)`, the index of the token that completes the text up to it.

    Binary search on decoded prefixes: a step ends at the first token whose prefix reaches its last
    character, whatever the tokenizer merged around it.
    """
    out = []
    for end in char_ends:
        lo, hi = 0, max(len(ids) - 1, 0)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(decode(ids[: mid + 1])) >= end:
                hi = mid
            else:
                lo = mid + 1
        out.append(lo)
    return out


def split_steps(completion: str, separator: str) -> list[str]:
    """A solution's steps: the text between separators, empty steps dropped."""
    return [step for step, _ in step_spans(completion, separator)]


def step_sequence(prompt_ids: list[int], pieces: list[list[int]]) -> tuple[list[int], list[int]]:
    """Prompt + step pieces (each step followed by the separator): (ids, index of each step's last token).

    A process reward model reads step i's score at its last token, the separator after it, in training
    (`alignflow.core.train.datasets`' `steps` rows) and scoring (the `prm` reward) alike.
    """
    ids, ends = list(prompt_ids), []
    for piece in pieces:
        ids += piece
        ends.append(len(ids) - 1)
    return ids, ends


def step_pieces(tokenizer, steps: list[str], separator: str) -> list[list[int]]:
    return tokenizer([s + separator for s in steps], add_special_tokens=False).input_ids if steps else []
