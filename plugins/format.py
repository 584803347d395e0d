"""format reward: 1.0 for DeepSeek-R1's `<think>...</think><answer>...</answer>` layout, else 0.0."""

from __future__ import annotations

import re

from alignflow.core import hookimpl

# Whitespace may surround the blocks; nothing else may sit between or after them.
R1_LAYOUT = re.compile(r"\s*<think>.*?</think>\s*<answer>.*?</answer>\s*", re.DOTALL)
TAGS = ("<think>", "</think>", "<answer>", "</answer>")


def has_r1_format(completion: str) -> bool:
    """Exactly one think block then exactly one answer block, with only whitespace after it."""
    if any(completion.count(tag) != 1 for tag in TAGS):
        return False
    return R1_LAYOUT.fullmatch(completion) is not None


def format_reward(prompts: list[str], completions: list[str], **columns) -> list[float | None]:
    """1.0 if a completion is `<think>...</think><answer>...</answer>` (R1's format), else 0.0."""
    return [float(has_r1_format(c)) for c in completions]


@hookimpl
def register_rewards(register):
    register("format", format_reward)
