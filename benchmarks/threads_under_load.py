"""One torch thread or two, on an idle machine and beside processes that keep cores busy.

The work is one training step of the tiny model (forward, backward and Adam on 32 rows of 96 tokens,
the cold start's shape) and one decode round (64 rows, 48 new tokens, the hf sampler), each run in a
fresh process per variant so the thread pool is new. For each number of busy processes (pure-Python
loops, one core each) the variants alternate, `--repeats` times: one thread, two, and two with
OpenMP's passive wait policy (idle threads sleep instead of spinning). The JSON gives the median step
and decode times per variant and each one's ratio to the first (above 1: slower than one thread).

    python benchmarks/threads_under_load.py --busy 0 1 2 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORKER = r"""
import json, statistics, sys, time
import torch
from alignflow.core.train.models import load_model, load_tokenizer
from alignflow.core.spec.settings import GenerationSettings
from alignflow.plugins.hf import HFSampler

torch.set_num_threads(int(sys.argv[2]))
model = load_model(sys.argv[1]).train()
opt = torch.optim.Adam(model.parameters(), lr=1e-4)
ids = torch.randint(3, 40, (32, 96), generator=torch.Generator().manual_seed(0))

def step():
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()

for _ in range(2):
    step()
times = []
for _ in range(int(sys.argv[3])):
    t = time.perf_counter()
    step()
    times.append(time.perf_counter() - t)
sampler = HFSampler(HFSampler.Config())
sampler.load(model.eval(), load_tokenizer(sys.argv[1]))
prompts = [[5 + i % 20, 7, 9] for i in range(64)]
gen = GenerationSettings(max_new_tokens=48, temperature=1.0)
sampler.generate(prompts[:8], 1, gen, seed=0)
t = time.perf_counter()
sampler.generate(prompts, 1, gen, seed=1)
print(json.dumps({"step": statistics.median(times), "decode": time.perf_counter() - t}))
"""

BUSY = "while True: pass"


VARIANTS = {"1t": (1, {}), "2t": (2, {}), "2t_passive": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
            "2t_spin10k": (2, {"GOMP_SPINCOUNT": "10000"}), "2t_spin100k": (2, {"GOMP_SPINCOUNT": "100000"})}


def measure(model: Path, threads: int, steps: int, extra_env: dict) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), **extra_env}
    out = subprocess.run([sys.executable, "-c", WORKER, str(model), str(threads), str(steps)], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--busy", type=int, nargs="+", default=[0, 1, 2], help="busy processes beside the work")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--variants", nargs="+", default=["1t", "2t", "2t_passive"], choices=list(VARIANTS),
                    help="the first is the baseline of the ratios")
    args = ap.parse_args()
    from alignflow.core.train.models import build_tiny

    model = build_tiny(Path(tempfile.mkdtemp()) / "tiny")
    results = {"cpus": os.cpu_count(), "runs": []}
    for busy in args.busy:
        loops = [subprocess.Popen([sys.executable, "-c", BUSY]) for _ in range(busy)]
        try:
            time.sleep(1.0)
            got: dict[str, list[dict]] = {name: [] for name in args.variants}
            for _ in range(args.repeats):
                for name in args.variants:  # alternating, so drifting load hits all alike
                    threads, env = VARIANTS[name]
                    got[name].append(measure(model, threads, args.steps, env))
        finally:
            for p in loops:
                p.kill()
                p.wait()
        row = {"busy": busy}
        for name, runs in got.items():
            for key in ("step", "decode"):
                row[f"{key}_s_{name}"] = round(statistics.median(r[key] for r in runs), 4)
        for name in args.variants[1:]:
            for key in ("step", "decode"):
                row[f"{key}_ratio_{name}_over_{args.variants[0]}"] = round(
                    row[f"{key}_s_{name}"] / row[f"{key}_s_{args.variants[0]}"], 2)
        results["runs"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
