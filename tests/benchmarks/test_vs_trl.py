"""benchmarks/vs_trl.py's pairing: `--trl-best` runs both TRL precisions in every pair and counts the faster;
its headline names the CPU kind and both sides' precision."""

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
TINY = {"H": 128, "I": 512, "L": 4, "V": 264, "heads": 4, "kv_heads": 2, "head_dim": 32}
AVX2_EPYC = {"cpu_model": "AMD EPYC 7B13", "cpu_capability": "AVX2",
             "isa_flags": {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_bf16": False}}


@pytest.fixture(scope="module")
def vs_trl():
    sys.path.insert(0, str(BENCHMARKS))  # vs_trl.py imports machine.py beside it, as it does when run
    try:
        spec = importlib.util.spec_from_file_location("vs_trl", BENCHMARKS / "vs_trl.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def run(precision: str, *step_s: float) -> dict:
    """A process's result: a warm-up step of 9 s, then `step_s`, 128 completions each."""
    steps = [{"completions": 128, "step": s, "generate": s / 2, "train": s / 2, "prompt_tokens": 1000,
              "tokens": 3000} for s in (9.0, *step_s)]
    return {"precision": precision, "steps": steps}


def test_the_faster_trl_precision_counts_in_each_pair(vs_trl):
    runs = {"trl_fp32": [run("fp32", 1.0, 1.2), run("fp32", 2.0, 2.0)],
            "trl_bf16": [run("bf16", 1.5, 1.5), run("bf16", 1.0, 2.6)]}
    faster = vs_trl.faster_per_pair(runs, warmup=1)
    assert [r["precision"] for r in faster] == ["fp32", "bf16"]  # medians 1.1 s against 1.5, then 2.0 against 1.8
    assert vs_trl.rate(faster[0], 1) == pytest.approx((128 / 1.0 + 128 / 1.2) / 2)  # the median of its steps


def test_trl_best_runs_both_precisions_every_pair_in_alternating_order(vs_trl, monkeypatch):
    order = []
    monkeypatch.setattr(vs_trl, "run_side", lambda args, side, *a: order.append(a[-1]) or run("fp32", 1.0))
    args = argparse.Namespace(trl_best=True, trl_precision="fp32", pairs=3, warmup=1, steps=1)
    runs = vs_trl.run_pairs(args, Path("m"), Path("p"), Path("t"), {})
    assert order == ["pair 0 alignflow", "pair 0 trl fp32", "pair 0 trl bf16", "pair 1 alignflow",
                     "pair 1 trl bf16", "pair 1 trl fp32", "pair 2 alignflow", "pair 2 trl fp32", "pair 2 trl bf16"]
    assert {k: len(v) for k, v in runs.items()} == {"alignflow": 3, "trl_fp32": 3, "trl_bf16": 3}


def test_share_of_bound_takes_each_runs_own_precision(vs_trl):
    bound = {"generate": {"fp32": 10.0, "bf16": 40.0}, "update": {"fp32": 10.0, "bf16": 40.0}}
    one = vs_trl.flops_summary([run("fp32", 1.0)], 1, TINY, bound)
    mixed = vs_trl.flops_summary([run("fp32", 1.0), run("bf16", 1.0)], 1, TINY, bound)
    assert mixed["precision"] == "bf16+fp32"
    assert mixed["gflops_per_s"] == one["gflops_per_s"]  # the same work in the same time
    # the median of one share against fp32's bound and one against bf16's (4x higher)
    assert mixed["share_of_bound"]["update"] == pytest.approx(one["share_of_bound"]["update"] * 0.625, abs=1e-3)


def test_headline_names_the_cpu_kind_and_both_precisions(vs_trl):
    args = argparse.Namespace(precision=None, trl_best=True, trl_precision="fp32", threads=1)
    first = vs_trl.headline(AVX2_EPYC, args)
    assert first.startswith("CPU AMD EPYC 7B13 (AVX2, no bf16 in hardware; torch kernels AVX2), 1 thread(s)")
    assert "alignflow auto (resolved in each process); TRL fp32 and bf16 in every pair" in first
    last = vs_trl.headline(AVX2_EPYC, args, "fp32", ["fp32", "bf16"])
    assert "alignflow auto -> fp32; " in last and last.endswith("the faster counted (faster: fp32, bf16)")
    avx512 = {**AVX2_EPYC, "isa_flags": {"avx2": True, "avx512f": True, "avx512_bf16": True}}
    assert "(AVX-512, bf16 in hardware;" in vs_trl.headline(avx512, argparse.Namespace(
        precision="bf16-mixed", trl_best=False, trl_precision="bf16", threads=2), "bf16-mixed", ["bf16"])
