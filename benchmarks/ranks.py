"""`--nproc`: an rl stage and a rejection_sampling stage on one process and on N data-parallel ranks.

    python benchmarks/ranks.py [--model builtin:tiny|PATH] [--nproc 2] [--steps 4] [--prompts 512]

Each stage runs as `alignflow run --nproc` runs it (flows/launch/child.py): one process with every thread,
then N ranks sharing the threads (or one GPU each). Prints JSON: per variant the wall seconds of the
stage (process start-up included) and, for rl, the median `time/step` rank 0 logged (GRPO, 64
prompts x 8, 48 new tokens); `ratio` is one process / N ranks, so above 1 means the ranks were faster.
The rejection_sampling rows must be the same bytes both ways (checked), the rl runs sample other
rollouts (each rank its own seed). Runs alternate between the variants, so load hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.kinds import settings_model
from alignflow.core.spec.schema import parse_spec
from alignflow.core.task.arithmetic import write_datasets
from alignflow.flows.launch.ranks import run_in_processes
from alignflow.flows.stages import StageContext

STAGES = {
    "rl": {"algorithm": "grpo", "rewards": ["math_accuracy"], "sampler": "hf",
           "settings": {"prompts_per_step": 64, "group_size": 8, "micro_batch_size": 128, "lr": 1e-4,
                        "log_every": 1, "save_every": 1000, "generation": {"max_new_tokens": 48}}},
    "rejection_sampling": {"rewards": ["math_accuracy"], "sampler": {"name": "hf", "config": {"batch_size": 512}},
                           "settings": {"n": 8, "output": "pairs", "generation": {"max_new_tokens": 48}}},
}


def run(kind: str, model: str, data: Path, out: Path, ranks: int, steps: int) -> dict:
    raw = {k: v for k, v in STAGES[kind].items()}
    if kind == "rl":
        raw["settings"] = {**raw["settings"], "max_steps": steps}
    spec = parse_spec({"name": "bench", "stages": {"s": {"kind": kind, "inputs": {"model": model, "dataset": str(data)},
                                                          **raw}}})
    stage, logged = spec.stages["s"], []
    inputs = {"model": Path(model) if Path(model).exists() else model, "dataset": data}
    out.mkdir(parents=True)
    ctx = StageContext("s", stage, settings_model(kind).model_validate(stage.settings), inputs, out / "work",
                       out / "checkpoints", 0, lambda m, s: logged.append(m), get_plugins())
    ctx.work_dir.mkdir()
    start = time.perf_counter()
    result = run_in_processes(kind, ctx, threads=max(1, torch.get_num_threads() // ranks), ranks=ranks)
    row = {"ranks": ranks, "wall_s": round(time.perf_counter() - start, 2)}
    if kind == "rl":
        row["step_s"] = round(statistics.median(m["time/step"] for m in logged if "time/step" in m), 3)
        row["accuracy"] = logged[-1].get("accuracy")  # the rollouts of the last step
    else:
        row["rows"] = result.metrics["rows_written"]
        row["bytes"] = (result.outputs["dataset"]).read_bytes()
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args()
    report = {"model": args.model, "nproc": args.nproc, "threads": torch.get_num_threads(),
              "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rows = write_datasets(root / "data")["rl"].read_text().splitlines()[: args.prompts]
        data = root / "prompts.jsonl"
        data.write_text("\n".join(rows) + "\n")
        for kind in ("rl", "rejection_sampling"):
            runs: dict[int, list[dict]] = {1: [], args.nproc: []}
            for r in range(args.repeats):
                for ranks in (1, args.nproc):
                    runs[ranks].append(run(kind, args.model, data, root / f"{kind}-{ranks}-{r}", ranks, args.steps))
            one, many = runs[1], runs[args.nproc]
            key = "step_s" if kind == "rl" else "wall_s"
            ratio = statistics.median(x[key] for x in one) / statistics.median(x[key] for x in many)
            entry = {"one_process": [{k: v for k, v in x.items() if k != "bytes"} for x in one],
                     f"{args.nproc}_ranks": [{k: v for k, v in x.items() if k != "bytes"} for x in many],
                     "ratio": round(ratio, 3)}
            if kind == "rejection_sampling":
                entry["same_rows"] = all(x["bytes"] == one[0]["bytes"] for x in one + many)
                if not entry["same_rows"]:
                    print(json.dumps({**report, kind: entry}), file=sys.stderr)
                    raise SystemExit("rejection_sampling wrote other rows on several ranks")
            report[kind] = entry
    print(json.dumps(report))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
