"""How often a model's own `judge` verdicts agree with the verifier, from `evaluate` stages' samples.

    python benchmarks/judge_agreement.py ARTIFACT [ARTIFACT ...] [--judge judge] [--out F.json]

Each ARTIFACT is the folder of an `evaluate` stage (`artifacts/eval.r1/<digest>`, as `alignflow run` lists them)
whose rewards are the verifier first and a `judge` reward (weight 0): its samples (`out/samples.jsonl`) hold
both per sample. Reported per artifact:
the verifier's accuracy, the judge's yes-rate, agreement (judge == verifier), and the judge's accuracy on
samples the verifier calls correct (recall of yes) and incorrect (recall of no); unparsed verdicts count as
disagreement. pipelines/self-rewarding-tiny.yaml is its use: its `eval_judge_sft` and `eval.r1..3` folders.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def agreement(path: Path, judge: str) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    verdicts = [r["rewards"].get(judge) for r in rows]
    right = [r["correct"] for r in rows]
    agree = [v is not None and (v >= 1) == c for v, c in zip(verdicts, right)]
    on = lambda want: [a for a, c in zip(agree, right) if c == want]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
    return {"samples": len(rows), "verifier_accuracy": mean(right),
            "judge_yes_rate": mean([v is not None and v >= 1 for v in verdicts]),
            "unparsed": sum(v is None for v in verdicts), "agreement": mean(agree),
            "judge_recall_correct": mean(on(True)), "judge_recall_incorrect": mean(on(False))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("artifacts", nargs="+", type=Path, help="evaluate stages' artifact folders")
    parser.add_argument("--judge", default="judge", help="the judge reward's name in the samples")
    parser.add_argument("--out")
    args = parser.parse_args()
    out = {str(a): agreement(a / "out" / "samples.jsonl", args.judge) for a in args.artifacts}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
