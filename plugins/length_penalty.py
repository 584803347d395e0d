"""length_penalty reward: Kimi k1.5's length reward, relative to the other samples of the same prompt."""

from __future__ import annotations

from alignflow.core import hookimpl
from alignflow.core.rewards import completion_lengths
from alignflow.plugins.math_accuracy import math_accuracy


def length_penalty(prompts: list[str], completions: list[str], answer: list, **columns) -> list[float | None]:
    """Kimi k1.5's length reward (arXiv 2501.12599, section 2.3.3): shorter than the prompt's other samples is better.

    Among the samples of one prompt, lambda_i = 0.5 - (len_i - min_len) / (max_len - min_len); the reward is
    lambda_i for a correct answer and min(0, lambda_i) for a wrong one, 0 for all when every length is equal.
    Samples are grouped by identical prompt text (rewards see no group id; the rl stage scores a prompt's G
    samples in one call, and a prompt drawn twice shares its min and max); a sample scored alone (a batch
    retried per sample) gets 0. Correctness is `math_accuracy`'s check of the `answer` column; no reference
    answer: None. Lengths are tokens (`completion_lengths`, else characters). The report weights it into the
    reward (set the reward's `weight`) after a warm-up without it: a first rl stage without, then one with it.
    """
    correct = math_accuracy(prompts, completions, answer)
    lengths = completion_lengths(completions, columns)
    groups: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        groups.setdefault(prompt, []).append(i)
    scores: list[float | None] = [None] * len(prompts)
    for rows in groups.values():
        shortest, longest = min(lengths[i] for i in rows), max(lengths[i] for i in rows)
        for i in rows:
            if correct[i] is None:
                continue
            if longest == shortest:
                scores[i] = 0.0
                continue
            lam = 0.5 - (lengths[i] - shortest) / (longest - shortest)
            scores[i] = lam if correct[i] == 1.0 else min(0.0, lam)
    return scores


@hookimpl
def register_rewards(register):
    register("length_penalty", length_penalty)
