"""Quality of Math-Shepherd step labels on the bundled task, against the exact labels it can give.

The task's worked solution (alignflow.core.task.arithmetic.work) fixes which steps are right: step k of a
sampled solution is correct exactly when steps 1..k equal the worked solution's. Prints one JSON
object: agreement, the share of correct steps labelled correct (recall) and of wrong steps labelled
correct (false positives), per difficulty level, for each `step_labels` output given.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from alignflow.core.train.steps import split_steps
from alignflow.core.task.arithmetic import parse, render, work


def exact_labels(prompt: str, steps: list[str], separator: str) -> list[int]:
    a, op, b = parse(prompt)
    reference = split_steps(render(*work(a, op, b)), separator)
    return [int(steps[: k + 1] == reference[: k + 1]) for k in range(len(steps))]


def compare(path: Path, separator: str) -> dict:
    pairs, by_level = Counter(), Counter()  # (exact, given) label counts; (level, agree) counts
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for exact, given in zip(exact_labels(row["prompt"], row["steps"], separator), row["step_labels"]):
            given = int(given > 0.5)
            pairs[exact, given] += 1
            by_level[row.get("level"), exact == given] += 1
    steps = sum(pairs.values())
    levels = sorted({level for level, _ in by_level}, key=str)
    return {
        "steps": steps,
        "agreement": (pairs[0, 0] + pairs[1, 1]) / steps,
        "recall": pairs[1, 1] / max(pairs[1, 1] + pairs[1, 0], 1),
        "false_positive_rate": pairs[0, 1] / max(pairs[0, 1] + pairs[0, 0], 1),
        "agreement_by_level": {str(lv): by_level[lv, True] / (by_level[lv, True] + by_level[lv, False])
                               for lv in levels},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("labels", nargs="+", type=Path, help="a step_labels stage's out/data.jsonl")
    parser.add_argument("--separator", default=" ", help="the stage's step_separator")
    args = parser.parse_args()
    print(json.dumps({str(p): compare(p, args.separator) for p in args.labels}, indent=1))


if __name__ == "__main__":
    main()
