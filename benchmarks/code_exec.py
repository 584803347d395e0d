"""Throughput of the code_exec reward: correct solutions scored in one call, in each isolation mode.

    python benchmarks/code_exec.py [--samples 64] [--workers 4] [--rounds 5]

Each round, alternating: `namespaces` (bubblewrap: fresh namespaces, read-only view, private tmpfs)
and `basic` (rlimits and a fresh uid) score `--samples` copies of a correct `add` against three
asserts with `--workers` samples at once; `bare` starts as many `python -I -c pass` interpreters,
the same number at once: the floor any one-process-per-sample sandbox pays. Prints JSON: seconds
per call of each (all rounds and the median), and each mode's median over bare's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

from alignflow.core.sandbox.runner import default_python
from alignflow.plugins.code_exec import CodeExec

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
GOOD = "```python\ndef add(a, b):\n    return a + b\n```"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    python = default_python()
    rewards = {mode: CodeExec(CodeExec.Config(workers=args.workers, isolation=mode))
               for mode in ("namespaces", "basic")}

    def bare() -> None:
        with ThreadPoolExecutor(args.workers) as pool:
            list(pool.map(lambda _: subprocess.run([python, "-I", "-c", "pass"], env={}, check=True),
                          range(args.samples)))

    def scored(mode: str):
        def call() -> None:
            out = rewards[mode](["p"] * args.samples, [GOOD] * args.samples, tests=[TESTS] * args.samples)
            assert list(out) == [1.0] * args.samples, out
        return call

    runs = {"namespaces": scored("namespaces"), "basic": scored("basic"), "bare": bare}
    for fn in runs.values():
        fn()  # warm-up: the interpreter's page cache, the namespace probe
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.rounds):
        for name, fn in runs.items():
            start = time.perf_counter()
            fn()
            seconds[name].append(round(time.perf_counter() - start, 3))
    median = {name: statistics.median(s) for name, s in seconds.items()}
    print(json.dumps({
        "samples": args.samples, "workers": args.workers, "python": python, "seconds": seconds,
        "median_s": median, "samples_per_s": {k: round(args.samples / v, 1) for k, v in median.items()},
        "over_bare": {k: round(median[k] / median["bare"], 2) for k in ("namespaces", "basic")},
    }, indent=1))


if __name__ == "__main__":
    main()
