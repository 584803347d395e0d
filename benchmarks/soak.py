"""Kill-anywhere soak: SIGKILL `alignflow run` at random moments, rerun each time, and check that the
finished run equals an uninterrupted one, every stage's output files and final metrics bit for bit.

    python benchmarks/soak.py [--kills 8] [--seed 0] [--pipeline pipelines/r1-tiny.yaml] [--set K=V ...]

By default it runs r1-tiny shortened (`SHORT`: a 200-step cold start checkpointed every 25 steps, 8 GRPO
steps checkpointed every 2) in a scratch copy of the project. First the control: one uninterrupted run
into its own artifacts root, timed, then rerun (all cached) to time a run's fixed cost. Then the soak:
into a second root, `--kills` moments drawn uniformly over the control's work and sorted; run i is
SIGKILLed (its whole process group, stage children included) after the fixed cost plus the gap since
moment i-1, so the kills land spread over the pipeline while each rerun resumes what the last left;
then one run to the end. Every file under each
stage's `out/` and every final metric must equal the control's. Prints JSON: the moments, which stages
had finished at each kill (from the manifests), the control's seconds, and what differs (nothing, when
it holds). Same machine, same threads: the comparison is exact, so run it where nothing else competes
for the cores.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from alignflow.core.fingerprint import cpu

REPO = Path(__file__).resolve().parents[1]
SHORT = ["cold_start.settings.max_steps=200", "cold_start.settings.save_every=25",
         "grpo.settings.max_steps=8", "grpo.settings.prompts_per_step=16", "grpo.settings.save_every=2"]


def run(project: Path, pipeline: str, overrides: list[str], artifacts: Path, metrics: Path,
        kill_after: float | None = None) -> tuple[int, float]:
    """(exit code, seconds) of one `alignflow run`; with `kill_after`, SIGKILLed (its whole group) then."""
    cmd = [str(Path(sys.executable).parent / "alignflow"), "run", pipeline, "--artifacts", str(artifacts),
           "--metrics", str(metrics)] + [a for o in overrides for a in ("--set", o)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=project, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        code = proc.wait(timeout=kill_after)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    return code, time.perf_counter() - start


def outputs(artifacts: Path) -> dict[str, str]:
    """{stage/digest/out/...: sha256} of every finished stage's output files."""
    found = {}
    for manifest in sorted(artifacts.glob("*/*/manifest.json")):
        for path in sorted((manifest.parent / "out").rglob("*")):
            if path.is_file():
                found[path.relative_to(artifacts).as_posix()] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def final_metrics(path: Path) -> dict[str, float]:
    """{stage.metric: value} of a run's `--metrics` file, which holds {stage: {metric: value}}."""
    return {f"{stage}.{k}": v for stage, metrics in json.loads(path.read_text()).items() for k, v in metrics.items()}


def finished(artifacts: Path) -> list[str]:
    return sorted(m.parent.parent.name for m in artifacts.glob("*/*/manifest.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--pipeline", default="pipelines/r1-tiny.yaml")
    ap.add_argument("--set", action="append", default=None, help="overrides (default: SHORT)")
    args = ap.parse_args()
    overrides = SHORT if args.set is None else args.set
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="alignflow-soak-") as tmp:
        project = Path(tmp) / "project"
        shutil.copytree(REPO, project, ignore=shutil.ignore_patterns(
            "artifacts", ".git", "mlruns", "mlflow.db", ".alignflow", "build", "*.egg-info", "site"))
        control, soaked = Path(tmp) / "control", Path(tmp) / "soaked"
        code, control_s = run(project, args.pipeline, overrides, control, Path(tmp) / "control.json")
        if code != 0:
            raise SystemExit(f"the uninterrupted run failed (exit {code})")
        code, fixed_s = run(project, args.pipeline, overrides, control, Path(tmp) / "cached.json")
        if code != 0:
            raise SystemExit(f"the cached rerun failed (exit {code})")
        moments = sorted(rng.uniform(0.0, control_s - fixed_s) for _ in range(args.kills))
        kills, last = [], 0.0
        for at in moments:
            code, _ = run(project, args.pipeline, overrides, soaked, Path(tmp) / "soaked.json",
                          kill_after=fixed_s + at - last)
            kills.append({"work_s": round(at, 2), "exit": code, "finished_stages": finished(soaked)})
            last = at
        code, last_s = run(project, args.pipeline, overrides, soaked, Path(tmp) / "soaked.json")
        want, got = outputs(control), outputs(soaked)
        metrics_a, metrics_b = final_metrics(Path(tmp) / "control.json"), final_metrics(Path(tmp) / "soaked.json")
        differ = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
        metric_differ = sorted(k for k in set(metrics_a) | set(metrics_b) if metrics_a.get(k) != metrics_b.get(k))
    print(json.dumps({
        "pipeline": args.pipeline, "overrides": overrides, "seed": args.seed, "kills": kills,
        "control_s": round(control_s, 1), "cached_rerun_s": round(fixed_s, 1), "last_run_s": round(last_s, 1),
        "last_exit": code,
        "files_compared": len(want), "files_differ": differ, "metrics_compared": len(metrics_a),
        "metrics_differ": metric_differ, "identical": code == 0 and not differ and not metric_differ,
        "machine": {**cpu(), "cores": os.cpu_count(), "threads": os.environ.get("OMP_NUM_THREADS", "1")},
    }, indent=1))


if __name__ == "__main__":
    main()
