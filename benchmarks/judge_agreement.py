"""How often a model's own `judge` verdicts agree with the verifier, from `evaluate` stages' samples.

    python benchmarks/judge_agreement.py artifacts/ STAGE [STAGE ...] [--judge judge] [--out F.json]

Each STAGE is an `evaluate` stage whose rewards are the verifier first and a `judge` reward (weight 0): its
samples (`out/samples.jsonl` of the stage's newest finished artifact) hold both per sample. Reported per stage:
the verifier's accuracy, the judge's yes-rate, agreement (judge == verifier), and the judge's accuracy on
samples the verifier calls correct (recall of yes) and incorrect (recall of no); unparsed verdicts count as
disagreement. pipelines/self-rewarding-tiny.yaml is its use: `eval_judge_sft eval.r1 eval.r2 eval.r3`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def newest_samples(root: Path, stage: str) -> Path:
    manifests = sorted((root / stage).glob("*/manifest.json"), key=lambda p: p.stat().st_mtime)
    if not manifests:
        raise SystemExit(f"{root / stage}: no finished artifact (no */manifest.json)")
    return manifests[-1].parent / "out" / "samples.jsonl"


def agreement(path: Path, judge: str) -> dict:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    verdicts = [r["rewards"].get(judge) for r in rows]
    right = [r["correct"] for r in rows]
    agree = [v is not None and (v >= 1) == c for v, c in zip(verdicts, right)]
    on = lambda want: [a for a, c in zip(agree, right) if c == want]  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"samples": len(rows), "verifier_accuracy": mean(right),
            "judge_yes_rate": mean([v is not None and v >= 1 for v in verdicts]),
            "unparsed": sum(v is None for v in verdicts), "agreement": mean(agree),
            "judge_recall_correct": mean(on(True)), "judge_recall_incorrect": mean(on(False))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="the artifacts folder")
    parser.add_argument("stages", nargs="+")
    parser.add_argument("--judge", default="judge", help="the judge reward's name in the samples")
    parser.add_argument("--out")
    args = parser.parse_args()
    out = {stage: agreement(newest_samples(args.root, stage), args.judge) for stage in args.stages}
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
