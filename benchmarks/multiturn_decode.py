"""Multi-turn episodes on the `hf` sampler with each episode's KV cache kept between turns, against a full prefill
of every turn's context: model tokens/s and episodes/s for 1-, 3- and 8-turn episodes.

    OMP_NUM_THREADS=1 python benchmarks/multiturn_decode.py [--model PATH] [--prompts 16] [--group 4] [--rounds 3]

The work: `--prompts` arithmetic problems (the tiny task's, level 2, seed 0), `--group` episodes each, played to
K = 1, 3 and 8 turns by an environment that answers each turn with a fixed line; sampled at temperature 1, at most
48 new tokens a turn, by the `hf` sampler's packed engine (`--engine`) in fp32 (`--dtype`). Without `--model`: the
tiny model freshly built (seed 0), its turns ended after ~12 tokens by a bias on the stop token (a random model
rarely stops on its own; a turn without a stop ends its episode, so a K-turn batch averages a little under K).
Per K, `off` (`episode_cache: false`) and `on` alternate after a warm-up each, on the same seeds: medians of
`--rounds`, and each round's time ratio off / on (median and range: a shared machine's load drifts less within a
round than across rounds). Each round checks that both gave the same token ids and reports the largest log-prob
difference. `--vllm` adds the `vllm` sampler (its prefix cache on) on `--model`; it needs the vLLM environment.
Prints JSON with the machine (lscpu's model name and ISA flags, the load average) and the commit.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
TURNS = (1, 3, 8)
REPLY = "\nnoted ({}). go on:\n"


def environment():
    from alignflow.core.environments import Environment, Step

    class FixedTurns(Environment):
        """Answers every turn with one line; the episode is over after the stage's `max_turns`."""

        def step(self, turn):
            return Step(REPLY.format(turn.index), reward=0.0)

    return FixedTurns


def policy(args, tmp: Path):
    """The model and tokenizer: `--model`, or the tiny model with a stop-token bias (see the module's text)."""
    from alignflow.core.train.models import build_tiny, load_model, load_tokenizer

    path = Path(args.model) if args.model else build_tiny(tmp / "tiny", seed=0, max_position_embeddings=2048)
    model, tok = load_model(path).eval(), load_tokenizer(path)
    if not args.model:
        head = torch.nn.Linear(model.config.hidden_size, len(tok), bias=True)
        with torch.no_grad():
            head.weight.copy_(model.lm_head.weight)
            head.bias.zero_()
            head.bias[tok.eos_token_id] = args.eos_bias
        model.lm_head = head
    return path, model, tok


def once(sampler, spec, tok, rows, group: int, gen, seed: int):
    """One batch of episodes: its Generation and its measures."""
    start = time.perf_counter()
    g = spec.generate(sampler, tok, rows, group, gen, seed)
    seconds = time.perf_counter() - start
    model_tokens = sum(sum(m) for m in g.loss_mask)
    return g, {"s": seconds, "model_tokens_per_s": model_tokens / seconds, "episodes_per_s": len(g) / seconds,
               "model_tokens": model_tokens, "turns_mean": sum(g.episodes["turns"]) / len(g),
               "episode_tokens_mean": sum(map(len, g.completion_ids)) / len(g)}


def compare(a, b) -> dict:
    """Whether two Generations hold the same ids, and their largest log-prob difference."""
    same = a.completion_ids == b.completion_ids
    diff = max((abs(x - y) for la, lb in zip(a.logprobs, b.logprobs) for x, y in zip(la, lb)), default=0.0)
    return {"same_ids": same, "max_abs_logprob_diff": diff if same else None}


def measure(args) -> dict:
    from alignflow.core.environments.episodes import Episodes
    from alignflow.core.spec.settings import GenerationSettings
    from alignflow.core.task.arithmetic import generate
    from alignflow.plugins.hf import HFSampler

    rng = random.Random(0)
    rows = [{"prompt": generate(2, rng).prompt} for _ in range(args.prompts)]
    gen = GenerationSettings(max_new_tokens=48, temperature=1.0)
    with tempfile.TemporaryDirectory() as tmp:
        path, model, tok = policy(args, Path(tmp))
        samplers = {}
        for name, cached in (("off", False), ("on", True)):
            samplers[name] = HFSampler(HFSampler.Config(engine=args.engine, dtype=args.dtype, episode_cache=cached))
            samplers[name].load(model, tok)
        if args.vllm:
            from alignflow.plugins.vllm_sampler import VLLMSampler

            samplers["vllm"] = VLLMSampler(VLLMSampler.Config())
            samplers["vllm"].load(path, tok)
        out = {}
        for turns in TURNS:
            spec = Episodes(environment(), None, max_turns=turns, max_tokens=turns * (48 + 64))
            runs: dict[str, list[dict]] = {k: [] for k in samplers}
            checks = []
            for r in range(args.rounds + 1):  # round 0 warms up
                got = {}
                for name, s in samplers.items():
                    counts = getattr(s, "caches", None)  # hf's prompt tokens prefilled and reused so far
                    before = (counts.prefilled, counts.reused) if counts is not None else None
                    got[name], m = once(s, spec, tok, rows, args.group, gen, seed=r)
                    if before is not None:
                        m["prefilled_tokens"] = counts.prefilled - before[0]
                        m["reused_tokens"] = counts.reused - before[1]
                    if r:
                        runs[name].append(m)
                if r:
                    checks.append(compare(got["off"], got["on"]))
            result = {name: {k: statistics.median(v[k] for v in values) for k in values[0]}
                      for name, values in runs.items()}
            for name, values in runs.items():
                result[name]["runs_s"] = [round(v["s"], 3) for v in values]
            result["on_vs_off"] = {k: result["on"][k] / result["off"][k]
                                   for k in ("model_tokens_per_s", "episodes_per_s")}
            pairs = sorted(off["s"] / on["s"] for off, on in zip(runs["off"], runs["on"]))
            result["on_vs_off_per_round"] = {"median": statistics.median(pairs), "min": pairs[0], "max": pairs[-1]}
            result["same_ids_every_round"] = all(c["same_ids"] for c in checks)
            result["max_abs_logprob_diff"] = max((c["max_abs_logprob_diff"] or 0.0) for c in checks)
            out[f"{turns}_turns"] = result
        if "vllm" in samplers:
            samplers["vllm"].close()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a checkpoint folder (r1-tiny's cold start, say); default: the tiny model")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--engine", default="packed", choices=("packed", "transformers"), help="the hf sampler's engine")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="the packed engine's decode dtype")
    p.add_argument("--eos-bias", type=float, default=3.0, help="the stop token's logit bias on the built tiny model")
    p.add_argument("--vllm", action="store_true", help="also the vllm sampler on --model (needs vLLM)")
    args = p.parse_args()
    if args.vllm and not args.model:
        p.error("--vllm needs --model: the engine loads a checkpoint folder")
    from machine import git_commit, lscpu

    info = lscpu()
    result = {"machine": info.get("Model name"),
              "flags": sorted(f for f in info.get("Flags", "").split() if f.startswith(("avx", "amx"))),
              "commit": git_commit(), "torch_threads": torch.get_num_threads(), "model": args.model or "tiny",
              "engine": args.engine, "dtype": args.dtype,
              "episodes": args.prompts * args.group, "rounds": args.rounds, "max_new_tokens": 48,
              "vllm": None if args.vllm else "not measured (run with --vllm in the vLLM environment)",
              "load_avg_start": [round(x, 2) for x in os.getloadavg()]}
    with contextlib.redirect_stdout(sys.stderr):
        result["turns"] = measure(args)
    result["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
