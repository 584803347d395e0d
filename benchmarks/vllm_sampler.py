"""Generation and RL-step throughput of the `vllm` sampler against `hf`, at the RL shape (16 prompts x 8, 48 new tokens).

    python benchmarks/vllm_sampler.py [--size tiny|30m] [--model PATH] [--repeats 3] [--rl-steps 2]

Needs vLLM (README, "Rollouts on vLLM"). Both samplers are loaded once; calls alternate hf, vllm, hf, vllm,
... after one warm-up call each, so load on the machine hits them alike; medians. `--size 30m` builds a
31M-parameter model of the tiny model's architecture (hidden 512, 8 layers). Then an `rl` stage step
(GRPO, lr 0 so both generate from the same policy) with each sampler, alternating the same way. Prints JSON;
ratios are vllm / hf throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

SIZES = {"tiny": {}, "30m": dict(hidden_size=512, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=8,
                                  num_key_value_heads=4)}


def prompts(tokenizer, k: int = 16) -> list[list[int]]:
    rows = [json.loads(line) for line in Path("data/rl.jsonl").read_text().splitlines()[:k]]
    return tokenizer([r["prompt"] for r in rows]).input_ids


def generation(samplers: dict, ids, repeats: int) -> dict:
    from alignflow.core.spec.settings import GenerationSettings

    gen = GenerationSettings(max_new_tokens=48, temperature=1.0)
    rates = {name: [] for name in samplers}
    for rep in range(repeats + 1):  # call 0 is the warm-up
        for name, sampler in samplers.items():
            start = time.perf_counter()
            out = sampler.generate(ids, 8, gen, seed=rep)
            if rep:
                rates[name].append(sum(out.lengths) / (time.perf_counter() - start))
    out = {name: {"tokens_per_s": statistics.median(r), "runs": r} for name, r in rates.items()}
    out["ratio"] = out["vllm"]["tokens_per_s"] / out["hf"]["tokens_per_s"]
    return out


def rl_steps(model: Path, steps: int) -> dict:
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec.settings import RLSettings
    from alignflow.core.spec.schema import StageSpec
    from alignflow.flows.stages import StageContext
    from alignflow.flows.stages.rl import stage as rl

    built, times = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("hf", "vllm"):
            s = RLSettings(prompts_per_step=16, group_size=8, micro_batch_size=32, lr=0.0, max_steps=steps + 1,
                           generation={"max_new_tokens": 48, "temperature": 1.0}, save_every=10**6,
                           overlap_rollouts=False)
            spec = StageSpec(kind="rl", inputs={"model": str(model), "dataset": "data/rl.jsonl"}, algorithm="grpo",
                             rewards=["math_accuracy"], sampler=name)
            work = Path(tmp) / name
            (work / "work").mkdir(parents=True)
            ctx = StageContext("bench", spec, s, {"model": model, "dataset": Path("data/rl.jsonl")}, work / "work",
                               work / "checkpoints", 0, lambda m, step: None, get_plugins())
            parts, _ = rl.build(ctx)
            rl.rl_step(ctx, parts, 0)  # warm-up
            built[name], times[name] = (ctx, parts), []
        for step in range(1, steps + 1):
            for name, (ctx, parts) in built.items():
                times[name].append(rl.rl_step(ctx, parts, step))
        for _, parts in built.values():
            parts.sampler.close()
    out = {name: {k: statistics.median(m[k] for m in runs) for k in
                  ("perf/completions_per_s", "time/step", "time/generate", "time/train")} for name, runs in times.items()}
    out["ratio"] = out["vllm"]["perf/completions_per_s"] / out["hf"]["perf/completions_per_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--model", help="a checkpoint folder instead of a freshly built model")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rl-steps", type=int, default=2)
    parser.add_argument("--bind", default="auto", help="the vllm sampler's cpu_threads_bind (e.g. 0-1: both cores)")
    args = parser.parse_args()
    with contextlib.redirect_stdout(sys.stderr):  # engine and library chatter off stdout
        out = measure(args)
    print(json.dumps(out, indent=2))


def measure(args) -> dict:
    from alignflow.core.train.models import build_tiny, load_model, load_tokenizer
    from alignflow.plugins.hf import HFSampler
    from alignflow.plugins.vllm_sampler import VLLMSampler

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else build_tiny(Path(tmp) / "model", seed=0, **SIZES[args.size])
        model, tokenizer = load_model(path).eval(), load_tokenizer(path)
        hf, vllm = HFSampler(), VLLMSampler(VLLMSampler.Config(cpu_threads_bind=args.bind))
        hf.load(model, tokenizer)
        start = time.perf_counter()
        vllm.load(path, tokenizer)
        started = time.perf_counter() - start
        out = {"config": {"model": str(args.model or args.size), "parameters": sum(p.numel() for p in model.parameters()),
                          "prompts": 16, "n": 8, "max_new_tokens": 48, "torch_threads": torch.get_num_threads(), "vllm_cpu_threads_bind": args.bind},
               "vllm_engine_start_s": started,
               "generation": generation({"hf": hf, "vllm": vllm}, prompts(tokenizer), args.repeats)}
        vllm.close()
        if args.rl_steps:
            out["rl_step"] = rl_steps(path, args.rl_steps)
    return out


if __name__ == "__main__":
    main()
