"""A training stage's precision: the `precision` setting resolved against the hardware and the model.

- `fp32`: fp32 weights, optimizer and compute.
- `bf16-mixed`: fp32 master weights and optimizer; forwards (and so their backwards) under
  `torch.autocast(device, bfloat16)`, which runs matmuls in bf16 and keeps reductions such as softmax and
  log-softmax in fp32. Log-probs and losses are taken in fp32 (core/train/logits.py upcasts bf16 logits).
- `bf16`: DeepSpeed's bf16 mode: bf16 weights (fp32 master copies in the optimizer), no autocast.
- `auto` resolves to one of the first two, never to `bf16`: on CUDA, `bf16-mixed` where the GPU has bf16;
  on a CPU, `fp32` unless it multiplies bf16 in hardware (AVX-512 BF16 or AMX), and then a short probe on the
  stage's own model (`probe`) picks `bf16-mixed` only where it runs a forward and backward at least
  `MIN_GAIN` faster than fp32. Models over `PROBE_MAX_PARAMS` skip the probe on such a CPU and get
  `bf16-mixed` (their matmuls are large enough for bf16 to pay, and a probe would cost minutes).

A run may fix what `auto` resolves to without looking at the hardware (`fp32` or `bf16-mixed`): its
`RunOptions.auto_precision` (ALIGNFLOW_AUTO_PRECISION, read where the run starts), passed down as `auto`. The
test suite sets `fp32`, so tests that compare exact numbers agree on every machine.
"""

from __future__ import annotations

import statistics
import time
from contextlib import nullcontext
from typing import NamedTuple

import torch

PRECISIONS = ("fp32", "bf16-mixed", "bf16")
MIN_GAIN = 0.10  # bf16-mixed on a CPU when its probe step is at least 10% faster than fp32's
PROBE_MAX_PARAMS = 200_000_000
PROBE_ROWS, PROBE_LENGTH = 32, 64  # at most; the stage's micro_batch_size and max_length when smaller
PROBE_FLOPS = 2e10  # at most ~6 x params x tokens per probe step: rows are cut to stay under it (>= 1 row)
PROBE_REPEATS = 3  # timed steps of each precision, after one warm-up each


class Resolved(NamedTuple):
    """The precision a stage trains in, the probe's median step seconds ({"fp32", "bf16-mixed"}; None without
    a probe) and why, in words, for the log."""

    precision: str
    probe_s: dict[str, float] | None
    reason: str


def cpu_has_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX-512 BF16 or AMX). Without either, torch's bf16
    matmuls are emulated: 1-2 GFLOP/s against ~70 for fp32 on an AVX2 EPYC core, and a step of the tiny
    model runs 6x slower than in fp32."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def weight_dtype(precision: str) -> torch.dtype:
    """The dtype a model's weights are kept in: bf16 only for `bf16` (`bf16-mixed` keeps fp32 weights)."""
    return torch.bfloat16 if precision == "bf16" else torch.float32


def autocast(precision: str, device: torch.device | str):
    """The context a forward runs in: bf16 autocast on `device`'s type for `bf16-mixed`, else nothing."""
    if precision == "bf16-mixed":
        return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)
    return nullcontext()


def resolve(settings, model: torch.nn.Module, auto: str | None = None) -> Resolved:
    """`settings.precision` for `model`; anything but `auto` passes through unchanged, and `auto` becomes `auto`
    (the run's `auto_precision`: fp32 or bf16-mixed) where given, else what the hardware and the probe say."""
    wanted = settings.precision
    if wanted != "auto":
        return Resolved(wanted, None, "set")
    if auto:
        if auto not in ("fp32", "bf16-mixed"):
            raise ValueError(f"auto precision {auto!r}: expected fp32 or bf16-mixed")
        return Resolved(auto, None, f"auto, the run's auto_precision={auto}")
    if torch.cuda.is_available():
        if torch.cuda.is_bf16_supported():
            return Resolved("bf16-mixed", None, "auto: the GPU has bf16")
        return Resolved("fp32", None, "auto: the GPU has no bf16")
    if not cpu_has_bf16():
        return Resolved("fp32", None, "auto: the CPU has no bf16 hardware (AVX-512 BF16 or AMX)")
    params = sum(p.numel() for p in model.parameters())
    if params > PROBE_MAX_PARAMS:
        return Resolved("bf16-mixed", None, f"auto: bf16 CPU, {params / 1e6:.0f}M parameters (no probe)")
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    if not vocab:
        return Resolved("fp32", None, "auto: no probe for a model without config.vocab_size")
    times = probe(model, settings.micro_batch_size, settings.max_length, vocab)
    faster = times["bf16-mixed"] <= (1 - MIN_GAIN) * times["fp32"]
    return Resolved("bf16-mixed" if faster else "fp32", times,
                    f"auto: probe bf16-mixed {times['bf16-mixed'] * 1e3:.1f} ms, fp32 {times['fp32'] * 1e3:.1f} ms")


def probe(model: torch.nn.Module, micro_batch_size: int, max_length: int, vocab: int) -> dict[str, float]:
    """Median seconds of a forward and backward of a random micro-batch in fp32 and in bf16-mixed, alternating,
    one warm-up and `PROBE_REPEATS` timed steps each. The model's gradients, its train/eval mode and the RNG
    (torch's CPU generator) are as they were before, so training is unchanged by the probe."""
    device = next(model.parameters()).device
    length = min(max_length, PROBE_LENGTH)
    params = sum(p.numel() for p in model.parameters())
    rows = max(1, min(micro_batch_size, PROBE_ROWS, int(PROBE_FLOPS / (6 * params * length))))
    saved = [(p, p.grad) for p in model.parameters()]
    times: dict[str, list[float]] = {"fp32": [], "bf16-mixed": []}
    with torch.random.fork_rng(devices=[]):
        ids = torch.randint(0, vocab, (rows, length), device=device)
        mask = torch.ones_like(ids)
        for repeat in range(PROBE_REPEATS + 1):
            for precision in times:
                for p, _ in saved:
                    p.grad = None
                start = time.perf_counter()
                with autocast(precision, device):
                    out = model(input_ids=ids, attention_mask=mask)
                out = getattr(out, "logits", out).float().mean()
                if out.requires_grad:
                    out.backward()
                if repeat:
                    times[precision].append(time.perf_counter() - start)
    for p, grad in saved:
        p.grad = grad
    return {k: statistics.median(v) for k, v in times.items()}


EAGER_UP_TO = 512  # max_length up to which bf16-mixed on a CPU attends with eager matmuls


def fit_attention(model: torch.nn.Module, resolved: str, settings) -> str | None:
    """Under bf16-mixed on a CPU, eager attention where the settings leave the choice to transformers and
    sequences are short: torch's CPU flash-attention kernel runs its bf16 backward several times slower than
    the matmuls it replaces (tiny model, forward + backward, 1 core: 84 against 42 ms at 32 x 40 tokens,
    117 against 75 at 16 x 128, 113 against 98 at 8 x 256; from 512 tokens sdpa is as fast or faster).
    Returns the implementation it set, or None."""
    device = next(model.parameters()).device
    config = getattr(model, "config", None)
    if (resolved != "bf16-mixed" or device.type != "cpu" or settings.model.attn_implementation is not None
            or settings.max_length > EAGER_UP_TO or getattr(config, "_attn_implementation", None) != "sdpa"
            or not hasattr(model, "set_attn_implementation")):
        return None
    model.set_attn_implementation("eager")
    return "eager"


def match_attention(model, like: torch.nn.Module):
    """`model` (a frozen reference or teacher) set to attend as the policy `like` does, so that at equal
    weights both give equal log-probs; returned for chaining. Models without the switch pass unchanged."""
    want = getattr(getattr(like, "config", None), "_attn_implementation", None)
    inner = getattr(model, "module", model)
    have = getattr(getattr(inner, "config", None), "_attn_implementation", None)
    if want and have and want != have and hasattr(inner, "set_attn_implementation"):
        inner.set_attn_implementation(want)
    return model

