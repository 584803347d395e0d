"""math_accuracy reward: 1.0 when the final answer equals the reference `answer`, else 0.0."""

from __future__ import annotations

import re
import threading

from alignflow.core import hookimpl

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
TIMEOUT_S = 5  # math-verify's own per-call limit; it uses SIGALRM, so only on the main thread
MAX_ANSWER_CHARS = 1000  # off the main thread there is no timeout: bound sympy's work instead
INTEGER = re.compile(r"-?\d{1,300}")  # two plain integers compare as numbers, without sympy's parser


def extract_answer(completion: str) -> str | None:
    """The last `<answer>...</answer>` content, else the last `\\boxed{...}` content, else None."""
    tagged = ANSWER_TAG.findall(completion)
    if tagged:
        return tagged[-1].strip()
    return last_boxed(completion)


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}`, with nested braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j].strip()
    return None


def normalize(answer: str) -> str:
    """Strip math delimiters, spaces and a trailing period so trivial variants compare equal."""
    answer = answer.strip().strip("$").strip()
    answer = re.sub(r"\s+", "", answer)
    return answer.rstrip(".")


def is_equivalent(pred: str, gold: str) -> bool:
    """Exact match after normalisation, else math-verify's symbolic/numeric equivalence."""
    pred, gold = normalize(pred), normalize(gold)
    if not pred or not gold:
        return False
    if pred == gold:
        return True
    if INTEGER.fullmatch(pred) and INTEGER.fullmatch(gold):  # math-verify's verdict on two integers, without sympy
        return int(pred) == int(gold)
    if len(pred) > MAX_ANSWER_CHARS:
        return False
    from math_verify import parse, verify  # imported lazily: it pulls in sympy

    timeout = TIMEOUT_S if threading.current_thread() is threading.main_thread() else None
    gold_parsed = parse(f"${gold}$", parsing_timeout=timeout)
    pred_parsed = parse(f"${pred}$", parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


def math_accuracy(prompts: list[str], completions: list[str], answer: list, **columns) -> list[float | None]:
    """1.0 if the `<answer>` (or last `\\boxed{}`) equals the reference `answer` (math-verify), else 0.0."""
    scores: list[float | None] = []
    for completion, gold in zip(completions, answer, strict=True):
        if gold is None:
            scores.append(None)  # no reference: no opinion
            continue
        pred = extract_answer(completion)
        scores.append(float(pred is not None and is_equivalent(pred, str(gold))))
    return scores


@hookimpl
def register_rewards(register):
    register("math_accuracy", math_accuracy)
