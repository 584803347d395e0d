"""The `rl` stage against TRL's GRPOTrainer on the same work: completions/s, tokens/s, time split, peak RSS, GFLOP/s.

    python benchmarks/vs_trl.py --trl-python ../venv-trl/bin/python [--size tiny|8m] [--model PATH]
        [--sft-steps 1000] [--model-cache DIR] [--pairs 5] [--steps 2] [--threads 1] [--trl-threads N]
        [--overlap] [--out F.json] [--precision auto|fp32|bf16-mixed|bf16] [--trl-precision fp32|bf16 | --trl-best]

TRL lives in an environment of its own, next to alignflow (benchmarks/README.md, "vs_trl.py", builds it).

The work, on both sides: GRPO without a KL term (TRL: `beta=0`, `loss_type="grpo"`, the same per-response
then per-batch mean as the `grpo` algorithm), 16 prompts x 8 completions per step, at most 48 new tokens
at temperature 1, one optimizer step per rollout of 4 accumulated micro-batches of 32, lr 1e-4 constant,
the `math_accuracy` reward, the same checkpoint and the same prompts in the same order (TRL's dataset is
the rows the `rl` stage draws, unshuffled), `--threads` torch threads per process.

The model: `--model PATH`, or a `--size` built here from seed 0 and given `--sft-steps` of the `sft` stage
on data/sft_noisy.jsonl (1000: r1-tiny's cold start exactly), so completions end as a trained model's do.
`--overlap` runs the stage with `overlap_rollouts` (its rollout worker takes `--threads` more threads:
compare against `--trl-threads` of the two together for the same cores).
Each side runs in a process of its own, alternating A/B/A/B (`--pairs` pairs), each process `--warmup` steps
(excluded) and then `--steps` measured steps. Ratios are alignflow / TRL, per pair, then the median.
`machine` says what it ran on; `bound` is torch.mm's GFLOP/s at each phase's matmul shapes, measured in a child
process of each side's threads before the pairs, and each side's `gflops_per_s` / `share_of_bound` the model
FLOPs of the work over the phase's time (benchmarks/machine.py). `--trl-best` runs TRL in fp32 and in bf16 in
every pair (their order alternating) and compares each pair against the faster of the two.
The first line printed (stderr) and the JSON's `headline` name the CPU kind and both sides' precision; the JSON
also keeps the command and the numerics epoch (a record the results pages can quote).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import get_args

from alignflow.core.fingerprint import NUMERICS
from alignflow.core.spec.settings import TrainSettings
from machine import achieved, cpu_kind, dims, machine, measure_bound

SIZES = {"tiny": {}, "8m": dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8,
                                num_key_value_heads=4, max_position_embeddings=256)}
SHAPE = dict(prompts=16, group_size=8, micro_batch=32, accumulation=4, max_new_tokens=48, lr=1e-4)
UPDATE_LENGTH = 40  # tokens per row for the update's bound (prompt + completion: ~33 on the tiny model)
PRECISIONS = get_args(TrainSettings.model_fields["precision"].annotation)  # the `precision` setting's values
PARTS = ("generate", "score", "train", "step")


def alignflow_side(args) -> list[dict]:
    """Steps of the `rl` stage itself (build, then `rl_step`), as a pipeline runs them."""
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec.settings import RLSettings
    from alignflow.core.spec.schema import StageSpec
    from alignflow.flows.stages import StageContext
    from alignflow.flows.stages.rl import stage as rl

    work = Path(args.work)
    s = RLSettings(prompts_per_step=SHAPE["prompts"], group_size=SHAPE["group_size"],
                   micro_batch_size=SHAPE["micro_batch"], lr=SHAPE["lr"], lr_scheduler="constant",
                   max_steps=args.warmup + args.steps, save_every=10**6, log_every=10**6,
                   generation={"max_new_tokens": SHAPE["max_new_tokens"], "temperature": 1.0},
                   overlap_rollouts=args.overlap, overlap_threads=args.threads, precision=args.precision or "auto")
    spec = StageSpec(kind="rl", inputs={"model": args.model, "dataset": args.dataset}, rewards=["math_accuracy"],
                     algorithm={"name": "grpo", "config": {"kl_loss_coef": 0.0}}, sampler=args.sampler)
    ctx = StageContext("bench", spec, s, {"model": Path(args.model), "dataset": Path(args.dataset)},
                       work / "work", work / "checkpoints", 0, lambda m, step: None, get_plugins())
    ctx.work_dir.mkdir(parents=True)
    parts, _ = rl.build(ctx)
    args.ran_precision = parts.engine.precision  # `auto` resolved on this machine for this model
    steps = []
    for step in range(args.warmup + args.steps):
        m = rl.rl_step(ctx, parts, step)
        steps.append({"completions": SHAPE["prompts"] * SHAPE["group_size"], "tokens": m["perf/tokens"],
                      "accuracy": m["accuracy"], "generate": m["time/generate"], "score": m["time/score"],
                      "train": m["time/prepare"] + m["time/train"], "step": m["time/step"],
                      "skipped_rows": m["actor/skipped_rows"]})
    parts.sampler.close()  # a rollout worker ends here, so its peak memory is counted below
    return steps


def trl_side(args) -> list[dict]:
    """Steps of TRL's GRPOTrainer on the same checkpoint, prompts (in order) and reward."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from alignflow.core.train.models import load_tokenizer
    from alignflow.plugins.math_accuracy import math_accuracy

    rows = [json.loads(line) for line in Path(args.prompts).read_text().splitlines()]
    steps: list[dict] = [dict.fromkeys(("tokens", "accuracy", "generate", "score"), 0.0)]
    marks: list[float] = []

    def reward(prompts, completions, answer, completion_ids=None, **_):
        scores = [float(v or 0.0) for v in math_accuracy(prompts, completions, answer)]
        steps[-1].update(tokens=float(sum(map(len, completion_ids))),
                         accuracy=sum(s >= 1 for s in scores) / len(scores))
        return scores

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())
            steps[-1]["step"] = marks[-1] - marks[-2]
            steps.append(dict.fromkeys(("tokens", "accuracy", "generate", "score"), 0.0))

    config = GRPOConfig(
        output_dir=str(Path(args.work) / "trl"), per_device_train_batch_size=SHAPE["micro_batch"],
        gradient_accumulation_steps=SHAPE["accumulation"], num_generations=SHAPE["group_size"],
        max_completion_length=SHAPE["max_new_tokens"], temperature=1.0, top_p=1.0, beta=0.0, loss_type="grpo",
        learning_rate=SHAPE["lr"], lr_scheduler_type="constant", max_steps=args.warmup + args.steps, num_iterations=1,
        shuffle_dataset=False, use_cpu=True, report_to=[], save_strategy="no", logging_steps=10**6, seed=0,
        disable_dropout=True, dataloader_num_workers=0,
        # TRL's GPU defaults are bf16 (autocast on the CPU) and gradient checkpointing; the `rl` stage has none
        bf16=args.trl_precision == "bf16", gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(model=AutoModelForCausalLM.from_pretrained(args.model), reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(rows), processing_class=load_tokenizer(args.model),
                          callbacks=[Clock()])
    for name, part in (("_generate_single_turn", "generate"), ("_calculate_rewards", "score")):
        trainer.__dict__[name] = timed(getattr(trainer, name), steps, part)
    trainer.train()
    steps = steps[: args.warmup + args.steps]
    for s in steps:
        s["completions"] = SHAPE["prompts"] * SHAPE["group_size"]
        s["train"] = s["step"] - s["generate"] - s["score"]
    return steps


def timed(fn, steps: list[dict], part: str):
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            steps[-1][part] += time.perf_counter() - start
    return wrapper


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    args.ran_precision = args.trl_precision
    steps = alignflow_side(args) if args.child == "alignflow" else trl_side(args)
    peak = {who: resource.getrusage(getattr(resource, f"RUSAGE_{who.upper()}")).ru_maxrss / 1024
            for who in ("self", "children")}  # children: the largest child process (the rollout worker among them)
    Path(args.result).write_text(json.dumps({"steps": steps, "precision": args.ran_precision,
                                             "peak_rss_mb": peak["self"],
                                             "children_peak_rss_mb": peak["children"]}))


def prepare_model(args, tmp: Path) -> Path:
    """`--model`, or a `--size` model from seed 0 after `--sft-steps` of the `sft` stage (kept in, and taken from,
    `--model-cache`/SIZE-STEPS: the SFT is a function of the seed)."""
    if args.model or not args.model_cache:
        return Path(args.model) if args.model else _sft_model(args, tmp)
    cached = Path(args.model_cache) / f"{args.size}-{args.sft_steps}"
    if not (cached / "config.json").is_file():
        shutil.copytree(_sft_model(args, tmp), cached.with_suffix(".partial"), dirs_exist_ok=True)
        cached.with_suffix(".partial").rename(cached)
    return cached


def _sft_model(args, tmp: Path) -> Path:
    from alignflow.core.train.models import build_tiny

    base = build_tiny(tmp / "base", seed=0, **SIZES[args.size])
    if not args.sft_steps:
        return base
    from alignflow.core.plugins import get_plugins
    from alignflow.core.spec.settings import TrainSettings
    from alignflow.core.spec.schema import StageSpec
    from alignflow.flows.stages import StageContext
    from alignflow.flows.stages.sft import run_sft

    s = TrainSettings(lr=2e-3, max_steps=args.sft_steps, batch_size=32, micro_batch_size=32, max_length=96,
                    warmup_ratio=0.05, save_every=10**6, log_every=10**6)
    spec = StageSpec(kind="sft", inputs={"model": str(base), "dataset": "data/sft_noisy.jsonl"}, algorithm="sft")
    ctx = StageContext("cold_start", spec, s, {"model": base, "dataset": Path("data/sft_noisy.jsonl")},
                       tmp / "sft" / "work", tmp / "sft" / "checkpoints", 0, lambda m, step: None, get_plugins())
    ctx.work_dir.mkdir(parents=True)
    return run_sft(ctx).outputs["model"]


def stage_prompts(args, path: Path) -> None:
    """The rows the `rl` stage draws at steps 0..steps, in order: TRL's unshuffled dataset."""
    from alignflow.core.train.datasets import load_rows
    from alignflow.flows.stages.rl.rollout import round_prompts

    rows = load_rows(Path(args.dataset), "prompt_answer").to_list()
    drawn = [rows[i] for step in range(args.warmup + args.steps)
             for i in round_prompts(step, 0, len(rows), SHAPE["prompts"], 0)]
    path.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": r["answer"]}) + "\n" for r in drawn))


def side_summary(runs: list[dict], warmup: int) -> dict:
    steps = [s for r in runs for s in r["steps"][warmup:]]  # each process's warm-up steps excluded
    med = lambda key: statistics.median(s[key] for s in steps)  # noqa: E731
    time_s = {k: med(k) for k in PARTS}
    return {"completions_per_s": statistics.median(s["completions"] / s["step"] for s in steps),
            "tokens_per_s": statistics.median(s["tokens"] / s["step"] for s in steps),
            "tokens_per_completion": statistics.mean(s["tokens"] / s["completions"] for s in steps),
            "accuracy": [round(s["accuracy"], 4) for s in steps],
            "time_s": time_s, "time_share": {k: time_s[k] / time_s["step"] for k in PARTS[:-1]},
            "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "children_peak_rss_mb": max(r["children_peak_rss_mb"] for r in runs),
            # rows the update did not forward: their loss and gradient are exactly 0 (TRL computes them)
            "skipped_rows": statistics.mean(s.get("skipped_rows", 0.0) for s in steps)}


def rate(run: dict, warmup: int) -> float:
    """A process's median completions/s over its measured steps."""
    return statistics.median(s["completions"] / s["step"] for s in run["steps"][warmup:])


def faster_per_pair(runs: dict[str, list[dict]], warmup: int) -> list[dict]:
    """Of the TRL runs of each pair (`trl_fp32`, `trl_bf16`), the one with more completions/s."""
    trl = [runs[k] for k in ("trl_fp32", "trl_bf16") if k in runs]
    return [max(pair, key=lambda r: rate(r, warmup)) for pair in zip(*trl)]


def headline(info: dict, args, ran: str | None = None, trl: list[str] | None = None) -> str:
    """The CPU kind and both sides' precision in one line: the first line printed, and the JSON's `headline`."""
    ours = args.precision or "auto"
    ours = f"{ours} -> {ran}" if ran and ran != ours else ours if ran else f"{ours} (resolved in each process)"
    theirs = "fp32 and bf16 in every pair, the faster counted" if args.trl_best else args.trl_precision
    theirs += f" (faster: {', '.join(trl)})" if trl and args.trl_best else ""
    return f"CPU {cpu_kind(info)}, {args.threads} thread(s); alignflow {ours}; TRL {theirs}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trl-python", default=sys.executable, help="python of the environment with TRL")
    parser.add_argument("--size", default="tiny", choices=sorted(SIZES))
    parser.add_argument("--model", help="a checkpoint to use instead of building one")
    parser.add_argument("--sft-steps", type=int, default=1000)
    parser.add_argument("--model-cache", help="keep the --size model after its SFT here, and reuse it next time")
    parser.add_argument("--dataset", default="data/rl.jsonl")
    parser.add_argument("--sampler", default="hf")
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="measured steps per process")
    parser.add_argument("--warmup", type=int, help="steps before them, excluded (default 1; 2 with --overlap, "
                                                   "whose first overlapped step waits for the worker to start)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--trl-threads", type=int, help="TRL's threads (default: --threads)")
    parser.add_argument("--overlap", action="store_true",
                        help="the rl stage with overlap_rollouts: a rollout worker of --threads threads besides")
    parser.add_argument("--precision", choices=PRECISIONS, help="the rl stage's `precision` setting (default auto: "
                        "the JSON records what it resolved to)")
    parser.add_argument("--trl-precision", choices=["fp32", "bf16"], default="fp32",
                        help="bf16: GRPOConfig(bf16=True), autocast on the CPU")
    parser.add_argument("--trl-best", action="store_true",
                        help="run TRL in fp32 and in bf16 in every pair; each pair's ratio is against the faster")
    parser.add_argument("--out", help="also write the JSON here")
    parser.add_argument("--child", choices=["alignflow", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.warmup is None:
        args.warmup = 2 if args.overlap else 1
    if args.child:
        return child(args)
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(args, Path(tmp))
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


def measure(args, tmp: Path) -> dict:
    # Taken before the SFT stage's process group sets MASTER_PORT, which the children must not inherit.
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    info = machine(args.trl_python)
    print(headline(info, args), file=sys.stderr, flush=True)
    model = prepare_model(args, tmp)
    prompts = tmp / "prompts.jsonl"
    stage_prompts(args, prompts)
    from transformers import AutoConfig

    d = dims(AutoConfig.from_pretrained(model))
    bounds = side_bounds(args, model, d, env, info["trl_env"].get("torch"))
    runs = run_pairs(args, model, prompts, tmp, env)
    prompt_tokens = step_prompt_tokens(model, prompts)
    for run in (r for side in runs.values() for r in side):
        for i, s in enumerate(run["steps"]):
            s["prompt_tokens"] = prompt_tokens[i]
    from alignflow.core.train.models import load_model

    runs["trl"] = faster_per_pair(runs, args.warmup)
    chosen = [r["precision"] for r in runs["trl"]]
    best = {"chosen": chosen, "completions_per_s": {p: [round(rate(r, args.warmup), 3) for r in runs[f"trl_{p}"]]
                                                    for p in ("fp32", "bf16")}} if args.trl_best else None
    if not args.trl_best:
        del runs[f"trl_{args.trl_precision}"]
    ratios = [rate(a, args.warmup) / rate(b, args.warmup) for a, b in zip(runs["alignflow"], runs["trl"])]
    info["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    return {"headline": headline(info, args, runs["alignflow"][0]["precision"], chosen), "machine": info,
            "numerics": NUMERICS, "command": " ".join(["python", "benchmarks/vs_trl.py", *sys.argv[1:]]),
            "config": {"model": str(args.model or args.size), "sft_steps": 0 if args.model else args.sft_steps,
                       "parameters": sum(p.numel() for p in load_model(model).parameters()), "dims": d,
                       "sampler": args.sampler, "threads": args.threads, "overlap_rollouts": args.overlap,
                       "trl_threads": trl_threads(args), "pairs": args.pairs,
                       "steps_per_process": args.steps, "warmup_steps": args.warmup, **SHAPE,
                       "precision": runs["alignflow"][0]["precision"], "precision_requested": args.precision,
                       "trl_precision": "best" if args.trl_best else args.trl_precision, "trl_best": best},
            "bound": bounds,
            **{side: {**side_summary(runs[side], args.warmup),
                      **flops_summary(runs[side], args.warmup, d, bounds[side.partition("_")[0]])} for side in runs},
            "completions_per_s_ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                        "pairs": [round(r, 3) for r in ratios]}}


def run_pairs(args, model: Path, prompts: Path, tmp: Path, env: dict) -> dict[str, list[dict]]:
    """`--pairs` rounds of one alignflow process, then TRL's: in `--trl-precision`, or with `--trl-best` in fp32
    and in bf16, which of the two runs first alternating from pair to pair."""
    trl = ("fp32", "bf16") if args.trl_best else (args.trl_precision,)
    runs: dict[str, list[dict]] = {"alignflow": [], **{f"trl_{p}": [] for p in trl}}
    for pair in range(args.pairs):
        runs["alignflow"].append(run_side(args, "alignflow", model, prompts, tmp / f"alignflow{pair}", env,
                                          args.warmup, args.steps, args.trl_precision, f"pair {pair} alignflow"))
        for p in trl if pair % 2 == 0 else trl[::-1]:
            runs[f"trl_{p}"].append(run_side(args, "trl", model, prompts, tmp / f"trl_{p}{pair}", env, args.warmup,
                                             args.steps, p, f"pair {pair} trl {p}"))
    return runs


def trl_threads(args) -> int:
    return args.trl_threads or args.threads


def run_side(args, side: str, model: Path, prompts: Path, work: Path, env: dict, warmup: int, steps: int,
             trl_precision: str, label: str) -> dict:
    """One process of one side: its result file's steps, precision and peak RSS."""
    python, threads = (sys.executable, args.threads) if side == "alignflow" else (args.trl_python, trl_threads(args))
    result = work.with_suffix(".json")
    cmd = [python, __file__, "--child", side, "--model", str(model), "--dataset", args.dataset,
           "--sampler", args.sampler, "--steps", str(steps), "--warmup", str(warmup), "--threads", str(threads),
           "--trl-precision", trl_precision,
           "--work", str(work), "--prompts", str(prompts), "--result", str(result)]
    cmd += ["--overlap"] if args.overlap else []
    cmd += ["--precision", args.precision] if args.precision else []
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": str(threads)}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"{label} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    out = json.loads(result.read_text())
    print(f"{label}: {[round(s['step'], 2) for s in out['steps']]} s/step", file=sys.stderr)
    return out


def side_bounds(args, model: Path, d: dict, env: dict, trl_torch: str | None) -> dict[str, dict]:
    """The matmul bound for each side's python and threads, measured once where the two are alike."""
    rows = {"generate": SHAPE["prompts"] * SHAPE["group_size"], "update": SHAPE["micro_batch"] * UPDATE_LENGTH}
    ours = measure_bound(sys.executable, model, args.threads, rows, env)
    from alignflow.core.fingerprint import library_versions

    if trl_threads(args) == args.threads and trl_torch == library_versions()["torch"]:
        return {"alignflow": ours, "trl": ours}
    return {"alignflow": ours, "trl": measure_bound(args.trl_python, model, trl_threads(args), rows, env)}


def step_prompt_tokens(model: Path, prompts: Path) -> list[int]:
    """Prompt tokens of each step's completions (a prompt once per completion: each row prefills its own
    copy), tokenised as the `rl` stage does; both sides draw the same prompts."""
    from alignflow.core.train.models import load_tokenizer
    from alignflow.flows.stages.scoring import prompt_ids

    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    lengths = [len(ids) for ids in prompt_ids(load_tokenizer(model), rows)]
    n = SHAPE["prompts"]
    return [SHAPE["group_size"] * sum(lengths[i:i + n]) for i in range(0, len(lengths), n)]


def flops_summary(runs: list[dict], warmup: int, d: dict, bound: dict) -> dict:
    """Median achieved GFLOP/s per phase over the measured steps, and its share of the bound at the side's
    resolved precision (fp32's bound for fp32, bf16's for bf16 and bf16-mixed)."""
    rows = SHAPE["prompts"] * SHAPE["group_size"]
    rates = [(achieved(d, s, rows), "fp32" if r["precision"] == "fp32" else "bf16")
             for r in runs for s in r["steps"][warmup:]]  # with --trl-best, TRL's runs can differ in precision
    out: dict = {"precision": "+".join(sorted({r["precision"] for r in runs})), "gflops_per_s": {},
                 "share_of_bound": {}}
    for phase in ("generate", "update"):
        out["gflops_per_s"][phase] = round(statistics.median(r[phase] for r, _ in rates), 2)
        out["share_of_bound"][phase] = round(statistics.median(r[phase] / bound[phase][k] for r, k in rates), 3)
    return out

if __name__ == "__main__":
    main()
