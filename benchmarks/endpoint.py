"""Episodes through the policy endpoint against the same episodes in-process: model tokens/s and episodes/s.

    python benchmarks/endpoint.py --model PATH [--prompts 32] [--group 8] [--rounds 3] [--command]

The work: examples/agents/arithmetic_retry.py (ask; on a wrong answer one more try with a hint) on the first
`--prompts` rows of data/rl.jsonl, `--group` episodes each, sampled at temperature 1 with 48 new tokens a turn by
the `hf` sampler. `inprocess` plays it as an `Environment` (reset/step) in the stage's process; `endpoint` as the
agent function, written against the `openai` SDK, calling the policy endpoint over HTTP; `--command` adds one
round of the agent as a program started per episode. Calls alternate in-process, endpoint, ... after one warm-up
each; medians. Prints JSON with the machine (lscpu's model name and ISA flags) and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
AGENT = ROOT / "examples" / "agents" / "arithmetic_retry.py"
sys.path.insert(0, str(ROOT / "benchmarks"))


def in_process_environment():
    from alignflow.core.environments import Environment, Step

    class ArithmeticRetry(Environment):
        """examples/agents/arithmetic_retry.py as reset/step: the same messages, the same rewards."""

        def reset(self, row, seed):
            self.answer = str(row["answer"])
            return row["prompt"]

        def step(self, turn):
            import re

            found = re.findall(r"<answer>(.*?)</answer>", turn.text, re.S)
            if found and found[-1].strip() == self.answer:
                return Step(reward=1.0 if turn.index == 0 else 0.5, done=True)
            return Step("\nno. again:\n", done=turn.index >= 1)

    return ArithmeticRetry


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="a checkpoint folder (r1-tiny's cold start, say)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--command", action="store_true", help="also one round with the agent as a program per episode")
    args = p.parse_args()

    from alignflow.core.environments.episodes import Episodes
    from alignflow.core.spec.settings import GenerationSettings
    from alignflow.core.train.models import load_model, load_tokenizer
    from alignflow.plugins.hf import HFSampler
    from alignflow.plugins.openai_agent import OpenAIAgent
    from machine import git_commit, lscpu

    model, tok = load_model(args.model).eval(), load_tokenizer(args.model)
    sampler = HFSampler(HFSampler.Config())
    sampler.load(model, tok)
    rows = [json.loads(line) for line in (ROOT / "data" / "rl.jsonl").read_text().splitlines()[: args.prompts]]
    gen = GenerationSettings(max_new_tokens=48, temperature=1.0)
    ways = {"inprocess": Episodes(in_process_environment(), None, max_turns=2, max_tokens=160),
            "endpoint": Episodes(OpenAIAgent, OpenAIAgent.Config(function=f"{AGENT}:agent"), max_turns=2,
                                 max_tokens=160)}
    runs: dict[str, list[dict]] = {k: [] for k in ways}

    def once(name: str, spec, seed: int) -> dict:
        start = time.perf_counter()
        g = spec.generate(sampler, tok, rows, args.group, gen, seed)
        seconds = time.perf_counter() - start
        model_tokens = sum(sum(m) for m in g.loss_mask)
        return {"s": seconds, "model_tokens_per_s": model_tokens / seconds, "episodes_per_s": len(rows) * args.group
                / seconds, "reward": sum(g.episodes["reward"]) / len(g), "turns": sum(g.episodes["turns"]) / len(g)}

    for r in range(args.rounds + 1):  # round 0 warms up
        for name, spec in ways.items():
            out = once(name, spec, seed=r)
            if r:
                runs[name].append(out)
    result = {"machine": lscpu().get("Model name"), "flags": sorted(f for f in lscpu().get("Flags", "").split()
                                                                      if f.startswith(("avx", "amx"))),
              "commit": git_commit(), "episodes": len(rows) * args.group, "rounds": args.rounds}
    for name, values in runs.items():
        result[name] = {k: statistics.median(v[k] for v in values) for k in values[0]}
        result[name]["runs_s"] = [round(v["s"], 3) for v in values]
    result["endpoint_vs_inprocess_tokens_per_s"] = (result["endpoint"]["model_tokens_per_s"]
                                                    / result["inprocess"]["model_tokens_per_s"])
    if args.command:
        spec = Episodes(OpenAIAgent, OpenAIAgent.Config(command=[sys.executable, str(AGENT)]), max_turns=2,
                        max_tokens=160)
        result["command"] = once("command", spec, seed=args.rounds + 1)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
