"""Asynchronous rollouts against the synchronous `rl` stage, on a long tail of episode lengths.

    OMP_NUM_THREADS=1 python benchmarks/async_rl.py --out metrics/async-rl.json [--pairs 2] [--steps 6]
        [--seeds 0 1 2] [--curve-steps 20] [--artifacts DIR]

The `grpo` stage of pipelines/async-tiny.yaml (episodes an openai-SDK agent drives through the policy endpoint,
asking again after each wrong answer: 1 to 8 turns) from one cached cold start. Throughput: `max_staleness` 0
(synchronous) on one and on two torch threads (`0t2`: the cores the asynchronous runs use, the worker's and the
stage's), 1, 2 and 4 (pinned weights, a thread each) in alternating order, `--pairs` times, `--steps` steps each; a setting's
completions/s is the episodes it trained on over the sum of its steps' wall time (`time/step`: generation the
stage waited for, scoring and the update), with the time the stage waited on its worker and the worker on the
stage. Curves: reward per step against episodes seen, synchronous and k = 2, for each stage seed of `--seeds`
(`grpo.settings.seed`: the same cold start), with the mean and standard error per step.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from machine import git_commit, lscpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PIPELINE = ROOT / "pipelines" / "async-tiny.yaml"
PER_STEP = 16 * 8  # prompts_per_step x group_size of the pipeline's grpo stage


def run(shared: Path, plots: Path, k: str, steps: int, seed: int) -> dict[str, list[float]]:
    """One pipeline run in an artifacts root of its own (the thread count is not in a digest: a shared root would
    hand a rerun on other threads the cached stage) beside the cold start of `shared`; the grpo stage's per-step
    curves of the metrics it logged. `k`: max_staleness, with `t2` on two torch threads (else one)."""
    staleness, _, threads = k.partition("t")
    artifacts = plots.with_name(plots.name + "-artifacts")
    artifacts.mkdir()
    if (shared / "cold_start").is_dir():
        (artifacts / "cold_start").symlink_to(shared / "cold_start")
    sets = {"grpo.settings.max_steps": steps, "grpo.settings.max_staleness": staleness, "grpo.settings.seed": seed}
    cmd = [sys.executable, "-m", "alignflow.flows.cli", "run", str(PIPELINE), "--json", "--artifacts", str(artifacts),
           "--plots", str(plots)] + [arg for key, value in sets.items() for arg in ("--set", f"{key}={value}")]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": threads or "1"})
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    if not (shared / "cold_start").exists():  # the first run trained it: the others take it from there
        shared.mkdir(parents=True, exist_ok=True)
        (artifacts / "cold_start").rename(shared / "cold_start")
    curves = {}
    for path in (plots / "grpo").glob("*.csv"):
        with path.open() as f:
            curves[path.stem] = [float(row["value"]) for row in csv.DictReader(f)]
    return curves


def throughput(curves: dict[str, list[float]]) -> dict[str, float]:
    total = sum(curves["time_step"])
    mean = lambda name: sum(curves.get(name, [0.0])) / max(len(curves.get(name, [])), 1)  # noqa: E731
    return {"completions_per_s": PER_STEP * len(curves["time_step"]) / total, "step_s": total / len(curves["time_step"]),
            "rollout_wait_s": mean("time_rollout_wait"), "worker_idle_s": mean("time_worker_idle"),
            "turns": mean("episode_turns"), "staleness_mean": mean("rollout_staleness_mean")}


def band(rows: list[list[float]]) -> dict[str, list[float]]:
    """Per step: the mean over seeds and its standard error."""
    n = len(rows)
    means = [sum(col) / n for col in zip(*rows)]
    se = [math.sqrt(sum((x - m) ** 2 for x in col) / (n - 1) / n) if n > 1 else 0.0
          for col, m in zip(zip(*rows), means)]
    return {"mean": means, "se": se}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--ks", nargs="+", default=["0", "0t2", "1", "2", "4"])
    p.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    p.add_argument("--curve-steps", type=int, default=20)
    p.add_argument("--artifacts", type=Path, help="where the cold start is kept between invocations")
    args = p.parse_args()
    info = lscpu()
    flags = set(info.get("Flags", "").split())
    record = {"machine": {"cpu_model": info.get("Model name"), "avx2": "avx2" in flags, "avx512f": "avx512f" in flags,
                          "avx512_bf16": "avx512_bf16" in flags, "cpus": len(os.sched_getaffinity(0)),
                          "load_avg_start": os.getloadavg()[0]},
              "commit": git_commit(), "pipeline": str(PIPELINE.relative_to(ROOT)), "steps": args.steps,
              "pairs": args.pairs, "throughput": {str(k): [] for k in args.ks}, "curves": {}}
    print(f"# {record['machine']['cpu_model']} (avx2 {record['machine']['avx2']}, avx512f "
          f"{record['machine']['avx512f']}), commit {record['commit']}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as tmp:
        artifacts = args.artifacts or Path(tmp) / "artifacts"
        for pair in range(args.pairs):
            order = args.ks if pair % 2 == 0 else args.ks[::-1]  # alternating: neither side always runs first
            for k in order:
                got = throughput(run(artifacts, Path(tmp) / f"t{pair}-{k}", k, args.steps, 0))
                record["throughput"][str(k)].append(got)
                print(f"pair {pair} k={k}: {got}", file=sys.stderr)
        base = [r["completions_per_s"] for r in record["throughput"]["0"]]
        record["speedup_vs_0"] = {k: sorted(r["completions_per_s"] / b for r, b in zip(rows, base))
                                  for k, rows in record["throughput"].items() if k != "0"}
        for k in ("0t2", "2") if args.seeds else ():
            rewards = [run(artifacts, Path(tmp) / f"c{seed}-{k}", k, args.curve_steps, seed)["reward_total_mean"]
                       for seed in args.seeds]
            record["curves"][str(k)] = {"episodes_seen": [PER_STEP * (i + 1) for i in range(args.curve_steps)],
                                        "seeds": args.seeds, "reward": rewards, **band(rewards)}
            print(f"curve k={k}: last {record['curves'][str(k)]['mean'][-1]:.3f}", file=sys.stderr)
    record["machine"]["load_avg_end"] = os.getloadavg()[0]
    args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
