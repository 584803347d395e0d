"""Throughput of one `rl` stage step: completions/s and where the time goes, against two baselines.

    python benchmarks/rl_step.py [--model builtin:tiny|PATH] [--steps 3] [--algorithm grpo] [--dtype bf16] [--zero 2]

Prints JSON for the stage's step and, measured in the same process on the same rollouts (lr 0 keeps
the policy fixed, so every variant generates the same completions; variants run interleaved so
load on the machine hits them alike): `recompute_old_logprobs` (an extra no-grad forward for pi_old
instead of the sampler's log-probs) and `pad_to_budget` (every micro-batch padded to the longest
prompt + max_new_tokens instead of its own longest sequence). Ratios are baseline / stage.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import statistics
import tempfile
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch.nn.functional as F

from alignflow.core.plugins import get_plugins
from alignflow.core.spec.settings import RLSettings
from alignflow.core.spec.schema import StageSpec
from alignflow.flows.stages import StageContext
from alignflow.flows.stages.rl import stage as rl
from alignflow.flows.stages.rl.rollout import Batch, to_batch

PARTS = ("generate", "score", "prepare", "train", "step")


class FullWidth(Batch):
    """A batch whose micro-batch views keep the whole padded width."""

    def view(self, rows):
        return self.input_ids[rows], self.attention_mask[rows], self.rollout.response_mask[rows]


@contextmanager
def padded_to(width: int):
    """Make the stage pad every batch to `width` columns for the duration."""
    def make(samples, pad_id, max_new_tokens, cost=None):
        b = to_batch(samples, pad_id, max_new_tokens, cost)
        extra = width - b.input_ids.shape[1]
        r = replace(b.rollout, response_mask=F.pad(b.rollout.response_mask, (0, extra)),
                    old_logprobs=F.pad(b.rollout.old_logprobs, (0, extra)))
        return FullWidth(F.pad(b.input_ids, (0, extra), value=pad_id), F.pad(b.attention_mask, (0, extra)), r)

    rl.to_batch = make
    try:
        yield
    finally:
        rl.to_batch = to_batch


def context(args, out: Path, **settings) -> StageContext:
    s = RLSettings(prompts_per_step=16, group_size=8, micro_batch_size=32, lr=0.0, max_steps=args.steps + 1,
                   generation={"max_new_tokens": 48, "temperature": 1.0}, save_every=10**6, dtype=args.dtype,
                   zero_stage=args.zero, **{"overlap_rollouts": False, **settings})  # the synchronous step
    inputs = {"model": args.model, "dataset": args.dataset}
    spec = StageSpec(kind="rl", inputs=inputs, algorithm=args.algorithm, rewards=["math_accuracy"], sampler="hf")
    model = args.model if args.model.startswith("builtin:") else Path(args.model)
    return StageContext("bench", spec, s, {"model": model, "dataset": Path(args.dataset)}, out / "work",
                        out / "checkpoints", 0, lambda m, step: None, get_plugins())


def summary(runs: list[dict]) -> dict:
    time = {k: statistics.median(m[f"time/{k}"] for m in runs) for k in PARTS}
    return {"completions_per_s": statistics.median(m["perf/completions_per_s"] for m in runs),
            "tokens_per_s": statistics.median(m["perf/tokens_per_s"] for m in runs),
            "response_length": statistics.median(m["response_length/mean"] for m in runs),
            "time_s": time, "time_share": {k: time[k] / time["step"] for k in PARTS[:-1]}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:tiny")
    parser.add_argument("--dataset", default="data/rl.jsonl")
    parser.add_argument("--algorithm", default="grpo")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--zero", type=int, default=0, choices=[0, 1, 2, 3])
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # library chatter (DeepSpeed's op builder) off stdout
        out = measure(args)
    print(json.dumps(out, indent=2))


def measure(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        ctx = context(args, Path(tmp))
        (Path(tmp) / "work").mkdir()
        parts, _ = rl.build(ctx)
        recompute = replace(ctx, settings=ctx.settings.model_copy(update={"recompute_old_logprobs": True}))
        width = max(len(ids) for ids in parts.tokenizer([r["prompt"] for r in parts.dataset]).input_ids) + 48
        rl.rl_step(ctx, parts, 0)  # warm-up: allocator, kernels, lazy imports
        runs = {"stage": [], "recompute_old_logprobs": [], "pad_to_budget": []}
        for step in range(1, args.steps + 1):
            runs["stage"].append(rl.rl_step(ctx, parts, step))
            runs["recompute_old_logprobs"].append(rl.rl_step(recompute, parts, step))
            with padded_to(width):
                runs["pad_to_budget"].append(rl.rl_step(ctx, parts, step))
    out = {"config": {"model": args.model, "algorithm": args.algorithm, "prompts": 16, "group_size": 8,
                      "max_new_tokens": 48, "steps": args.steps, "dtype": args.dtype, "zero_stage": args.zero},
           **{name: summary(r) for name, r in runs.items()}}
    lean = out["stage"]["time_s"]
    for name in ("recompute_old_logprobs", "pad_to_budget"):
        t = out[name]["time_s"]
        out[name]["ratio"] = {"step": t["step"] / lean["step"],
                              "prepare+train": (t["prepare"] + t["train"]) / (lean["prepare"] + lean["train"])}
    return out


if __name__ == "__main__":
    main()
