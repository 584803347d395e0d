"""A run record over seeds: each seed's metrics, digests and machine fingerprint from its artifacts, with the mean
and standard error of the chosen metrics.

    python benchmarks/seed_band.py --pipeline pipelines/agent-tiny.yaml --metric accuracy \\
        --metric reward/total/mean ARTIFACTS_ROOT:SEED [ARTIFACTS_ROOT:SEED ...] > metrics/bands/agent-tiny.json

Each ARTIFACTS_ROOT is the `--artifacts` folder of one `alignflow run PIPELINE --set seed=SEED`; the record holds,
per seed and stage, the manifest's digest, seed, fingerprint and metrics, and per stage and metric the mean over
seeds and its standard error (the sample standard deviation over sqrt(seeds)), and the numerics epoch of the code
that wrote it (`alignflow.core.fingerprint.NUMERICS`: a record of an earlier epoch is stale).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def manifests(root: Path, seed: int) -> dict[str, dict]:
    """The manifest of each stage run with `seed` under an artifacts root, by stage name."""
    found = {}
    for path in root.glob("*/*/manifest.json"):
        manifest = json.loads(path.read_text())
        if manifest.get("seed") == seed:
            found[manifest["stage"]] = manifest
    return found


def band(values: list[float]) -> dict:
    mean = sum(values) / len(values)
    if len(values) < 2:
        return {"mean": mean, "se": None, "values": values}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    return {"mean": mean, "se": sd / math.sqrt(len(values)), "values": values}


def main() -> None:
    from machine import git_commit

    from alignflow.core.fingerprint import NUMERICS

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pipeline", required=True)
    p.add_argument("--metric", action="append", required=True)
    p.add_argument("--code", help="the commit (or range) the runs ran on, where it is not the one checked out now")
    p.add_argument("runs", nargs="+", help="ARTIFACTS_ROOT:SEED")
    args = p.parse_args()
    seeds = {}
    for run in args.runs:
        root, _, seed = run.rpartition(":")
        stages = manifests(Path(root), int(seed))
        seeds[seed] = {name: {k: m[k] for k in ("digest", "seed", "fingerprint", "metrics")}
                       for name, m in sorted(stages.items())}
    names = sorted({s for stages in seeds.values() for s in stages})
    bands = {name: {metric: band([stages[name]["metrics"][metric] for stages in seeds.values()])
                    for metric in args.metric if all(metric in st.get(name, {}).get("metrics", {})
                                                     for st in seeds.values())}
             for name in names}
    record = {"pipeline": args.pipeline, "commit": args.code or git_commit(), "numerics": NUMERICS,
              "command": f"alignflow run {args.pipeline} --set seed=SEED", "bands": bands, "seeds": seeds}
    print(json.dumps(record, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
