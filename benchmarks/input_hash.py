"""Planning cost of a large local model input: hashing it every run against the project's hash cache.

    python benchmarks/input_hash.py [--gib 1.0] [--files 4] [--repeats 3]

Writes a checkpoint-like folder of `--files` random files (`--gib` in all) into a temporary project,
then plans a one-stage pipeline that takes it as its model input, `--repeats` times each way,
interleaved: `no_cache` hashes every file on every plan (what planning did before the cache);
`cached` is what `alignflow run` does, with `.alignflow/hashes.sqlite` already filled by a first
plan. Prints JSON: the median seconds of each and `ratio` = no_cache / cached. Both give the same
digest (checked).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.schema import parse_spec
from alignflow.flows import digest as dg
from alignflow.flows.plan import plan_pipeline

SPEC = {"name": "bench", "stages": {"sft": {"kind": "sft", "algorithm": "sft",
                                           "inputs": {"model": "model", "dataset": "data.jsonl"}}}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        project = Path(tmp)
        (project / "data.jsonl").write_text('{"prompt": "1+1=", "completion": "2"}\n')
        model = project / "model"
        model.mkdir()
        per_file = int(args.gib * 2**30 / args.files)
        for i in range(args.files):
            with (model / f"shard-{i}.safetensors").open("wb") as f:
                for offset in range(0, per_file, 2**24):
                    f.write(os.urandom(min(2**24, per_file - offset)))
        old = time.time() - 60  # written long enough ago to be remembered (see HashCache.RACY_SECONDS)
        for p in [*model.iterdir(), project / "data.jsonl"]:
            os.utime(p, (old, old))
        spec, plugins = parse_spec(SPEC), get_plugins()

        def plan_once(cached: bool) -> tuple[float, str]:
            if not cached:  # planning as it was: every input file read in full
                real = dg.project_hash_cache
                dg.project_hash_cache = lambda project: dg.NO_CACHE
            start = time.perf_counter()
            try:
                digest = plan_pipeline(spec, project, plugins)["sft"].digest
            finally:
                if not cached:
                    dg.project_hash_cache = real
            return time.perf_counter() - start, digest

        _, first = plan_once(cached=True)  # fills the cache
        times: dict[str, list[float]] = {"no_cache": [], "cached": []}
        for _ in range(args.repeats):
            for name in times:
                seconds, digest = plan_once(cached=name == "cached")
                assert digest == first, "the cache changed the digest"
                times[name].append(seconds)
        med = {name: statistics.median(t) for name, t in times.items()}
        print(json.dumps({
            "input_gib": round(per_file * args.files / 2**30, 3), "files": args.files,
            "repeats": args.repeats, "no_cache_s": round(med["no_cache"], 4), "cached_s": round(med["cached"], 4),
            "ratio": round(med["no_cache"] / med["cached"], 1),
        }))


if __name__ == "__main__":
    main()
