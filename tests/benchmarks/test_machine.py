"""benchmarks/machine.py's model FLOPs: the matmul shapes, a token's forward pass and a step's GFLOP/s."""

import importlib.util
from pathlib import Path

import pytest

MACHINE = Path(__file__).resolve().parents[2] / "benchmarks" / "machine.py"
# r1-tiny's model: hidden 128, intermediate 512, 4 layers, vocab 264, 4 heads of 32, 2 kv heads
TINY = {"H": 128, "I": 512, "L": 4, "V": 264, "heads": 4, "kv_heads": 2, "head_dim": 32}


def _machine():
    spec = importlib.util.spec_from_file_location("machine", MACHINE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_shapes_follow_the_config():
    shapes = {name: (m, k, n, t) for name, m, k, n, t in _machine().shapes(TINY, 128)}
    assert shapes == {"qkv": (128, 128, 256, 4), "o": (128, 128, 128, 4), "gate_up": (128, 128, 1024, 4),
                      "down": (128, 512, 128, 4), "lm_head": (128, 128, 264, 1)}


def test_forward_flops_are_twice_the_matmul_parameters_plus_attention():
    params = 4 * (128 * 256 + 128 * 128 + 128 * 1024 + 512 * 128) + 128 * 264
    assert _machine().forward_flops(TINY, 0) == 2 * params
    assert _machine().forward_flops(TINY, 10) == 2 * params + 4 * 4 * 10 * 128


def test_achieved_counts_prompts_and_leaves_out_skipped_rows():
    m = _machine()
    step = {"prompt_tokens": 1000, "tokens": 3000, "generate": 0.5, "train": 2.0, "skipped_rows": 0.25}
    forward = m.forward_flops(TINY, 4000 / 128 / 2) * 4000
    rates = m.achieved(TINY, step, 128)
    assert rates["generate"] == pytest.approx(forward / 0.5 / 1e9)
    assert rates["update"] == pytest.approx(3 * forward * 0.75 / 2.0 / 1e9)
