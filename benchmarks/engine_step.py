"""One optimizer step of the training engine (SFT loss) across precisions and ZeRO stages.

Every stage trains through `Engine`; this measures its step on a Qwen2 model of a chosen size (or
`--model`: a checkpoint's config, freshly initialised), random tokens, the SFT plugin's loss (prompt half
masked), for each variant in one process, `--rounds` rounds of the variants in turn (alternating):
tokens/s, the median step time, peak accelerator memory, and the ratio of each variant's step time to
the first variant's (the baseline, fp32 ZeRO-0 by default), measured in the same run.

    python benchmarks/engine_step.py --hidden 1024 --layers 12 --vocab 32000 --seq 1024 \
        --batch 16 --micro 8 --steps 6 --variants fp32:0 bf16-mixed:0 bf16:0 bf16:2 bf16:3

A variant is `precision:zero_stage`, the precision one of the `precision` setting's (fp32, bf16-mixed,
bf16; see core/train/precision.py). Where bf16 overtakes fp32 on a CPU as the model grows:

    python benchmarks/engine_step.py --model <r1-tiny cold start> --seq 64 --batch 32 --micro 32 \
        --threads 1 --rounds 2 --variants fp32:0 bf16-mixed:0 bf16:0
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time

import torch
import transformers

from alignflow.core.train.engine import Engine
from alignflow.core.train.models import token_logprobs
from alignflow.core.train.offline import TokenBatch
from alignflow.core.spec.settings import TrainSettings
from alignflow.plugins.sft import SFT


def model(args) -> torch.nn.Module:
    torch.manual_seed(0)
    if args.model:
        config = transformers.AutoConfig.from_pretrained(args.model)
        return transformers.AutoModelForCausalLM.from_config(config).float()
    config = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 2.75) // 64 * 64,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 256),
        max_position_embeddings=args.seq, tie_word_embeddings=True, use_sliding_window=False,
    )
    return transformers.Qwen2ForCausalLM(config).float()


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run(args, precision: str, zero: int) -> dict:
    settings = TrainSettings(batch_size=args.batch, micro_batch_size=args.micro, lr=1e-4, precision=precision,
                             zero_stage=zero, grad_clip=1.0)
    net = model(args)
    params = sum(p.numel() for p in net.parameters())
    engine = Engine.create(net, settings, total_steps=args.steps + 1)
    algo = SFT(SFT.Config())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g).to(engine.device)
    attn = torch.ones_like(ids)
    labels = torch.zeros_like(ids)
    labels[:, args.seq // 2:] = 1  # the completion half, as SFT trains it
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in engine.steps():
        sync()
        start = time.perf_counter()
        micros = [slice(i, i + args.micro) for i in range(0, args.batch, args.micro)]
        norm = engine.step_norm([labels[m] for m in micros])
        loss = torch.zeros((), device=engine.device)
        for m in micros:
            with engine.autocast():
                logps = token_logprobs(engine.model, ids[m], attn[m], labels[m])
            micro_loss, _ = algo.loss(TokenBatch(logps=logps, mask=labels[m]), norm)
            engine.backward(micro_loss)
            loss += micro_loss.detach()
        engine.step()
        losses.append(loss.item())  # one sync a step, after the update
        sync()
        if step:  # step 0 warms the allocator and the kernels
            times.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
    tokens = args.batch * args.seq
    t = statistics.median(times)
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"params": params, "step_s": t, "tokens_per_s": tokens / t, "peak_gib": peak,
            "loss_first": losses[0], "loss_last": losses[-1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint whose config to build (instead of --hidden/--layers)")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=["fp32:0", "bf16:0", "fp32:2", "fp32:3"],
                        help="precision:zero_stage; the first is the baseline")
    parser.add_argument("--rounds", type=int, default=1, help="rounds of all variants, in turn; medians over them")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.model:  # random tokens from the checkpoint's own vocabulary
        args.vocab = transformers.AutoConfig.from_pretrained(args.model).vocab_size
    out = {"config": {**vars(args),
                      "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
                      "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability()},
           "variants": {}}
    runs: dict[str, list[dict]] = {v: [] for v in args.variants}
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's chatter off stdout
        for _ in range(args.rounds):
            for v in args.variants:
                precision, zero = v.split(":")
                runs[v].append(run(args, precision, int(zero)))
    for v, results in runs.items():
        out["variants"][v] = {**results[-1], "step_s": statistics.median(r["step_s"] for r in results),
                              "step_s_rounds": [r["step_s"] for r in results]}
        out["variants"][v]["tokens_per_s"] = args.batch * args.seq / out["variants"][v]["step_s"]
    base = out["variants"][args.variants[0]]["step_s"]
    for r in out["variants"].values():
        r["ratio_to_baseline"] = r["step_s"] / base
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
