"""vs_trl.py's measures of the machine: what it is, a matmul bound at the model's shapes, and model FLOPs.

    python benchmarks/machine.py bound --model PATH --threads 1 --rows generate=128 update=1280

prints the bound as JSON: GFLOP/s of `torch.mm` at the matmul shapes of one forward pass of the model at that
many rows, fp32 and bf16, in this process with `--threads` torch threads (run it with OMP_NUM_THREADS set to
the same). A phase's bound is FLOP-weighted: the FLOPs of its shape mix over the time of the mix.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")
DTYPES = ("fp32", "bf16")
ROOT = Path(__file__).resolve().parents[1]
TRL_VERSIONS = ("import importlib.metadata as m, json; "
                "print(json.dumps({k: m.version(k) for k in ('trl', 'torch', 'transformers', 'accelerate')}))")


def lscpu() -> dict[str, str]:
    """lscpu's `key: value` lines; empty where there is no lscpu."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, env={**os.environ, "LC_ALL": "C"})
    except (OSError, subprocess.CalledProcessError):
        return {}
    pairs = (line.partition(":") for line in out.stdout.splitlines())
    return {k.strip(): v.strip() for k, _, v in pairs if v.strip()}


def git_commit() -> str | None:
    """`git rev-parse --short HEAD`, with `-dirty` where tracked files differ from it."""
    def git(*cmd: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *cmd], capture_output=True, text=True, check=True).stdout
    try:
        head = git("rev-parse", "--short", "HEAD").strip()
        return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def python_versions(python: str) -> dict[str, str | None]:
    """trl, torch, transformers and accelerate as another environment's python sees them."""
    try:
        out = subprocess.run([python, "-c", TRL_VERSIONS], capture_output=True, text=True, check=True).stdout
        return json.loads(out)
    except (OSError, subprocess.CalledProcessError, json.JSONDecodeError):
        return {"trl": None}


def machine(trl_python: str) -> dict:
    """The machine, its load now (`load_avg_end` is added at the end) and the software on both sides."""
    from alignflow.core.fingerprint import cpu, gpu, library_versions

    info, fp = lscpu(), cpu()
    flags = set(info.get("Flags", "").split())
    number = lambda key: int(info[key]) if info.get(key, "").isdigit() else None  # noqa: E731
    return {"cpu_model": info.get("Model name") or fp["cpu_model"], "cpu_family": number("CPU family"),
            "cpu_model_number": number("Model"),
            "isa_flags": {f: f in flags for f in ISA_FLAGS} if flags else None,
            "cpu_capability": fp["cpu_capability"],  # the kernels torch picked; ATEN_CPU_CAPABILITY can lower it
            "aten_cpu_capability_env": os.environ.get("ATEN_CPU_CAPABILITY"),
            "logical_cpus": os.cpu_count(), "affinity_cpus": len(os.sched_getaffinity(0)),
            "load_avg_start": [round(x, 2) for x in os.getloadavg()], "load_avg_end": None,
            "python": platform.python_version(), "alignflow_env": library_versions(),
            "trl_env": python_versions(trl_python), "gpu": gpu()["gpu"], "commit": git_commit(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds")}


def cpu_kind(info: dict) -> str:
    """`machine`'s CPU in one phrase: the model name and the ISA levels that pick its matmul kernels."""
    flags = info.get("isa_flags")
    if not flags:
        return f"{info['cpu_model']} (ISA flags unknown; torch kernels {info['cpu_capability']})"
    has = lambda *names: any(flags.get(n) for n in names)  # noqa: E731
    isa = "AVX-512" if has("avx512f") else "AVX2" if has("avx2") else "no AVX2"
    bf16 = "bf16 in hardware" if has("avx512_bf16", "amx_bf16") else "no bf16 in hardware"
    return f"{info['cpu_model']} ({isa}, {bf16}; torch kernels {info['cpu_capability']})"


def dims(config) -> dict[str, int]:
    """A causal LM config's sizes: hidden H, intermediate I, layers L, vocab V, heads, kv_heads, head_dim."""
    heads = config.num_attention_heads
    return {"H": config.hidden_size, "I": config.intermediate_size, "L": config.num_hidden_layers,
            "V": config.vocab_size, "heads": heads, "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads}


def shapes(d: dict[str, int], rows: int) -> list[tuple[str, int, int, int, int]]:
    """(name, rows, in, out, times per forward pass) of the matmuls of one forward pass (Qwen2/Llama layout)."""
    H, I, L, hd = d["H"], d["I"], d["L"], d["head_dim"]  # noqa: E741
    return [("qkv", rows, H, (d["heads"] + 2 * d["kv_heads"]) * hd, L), ("o", rows, d["heads"] * hd, H, L),
            ("gate_up", rows, H, 2 * I, L), ("down", rows, I, H, L), ("lm_head", rows, H, d["V"], 1)]


def forward_flops(d: dict[str, int], ctx: float) -> float:
    """FLOPs of one token's forward pass at a mean causal context of `ctx` tokens: 2 x the matmul parameters
    (the layers' projections and the lm_head, tied or not; embeddings, norms and biases left out) plus the
    attention's scores and values, 4 x layers x ctx x (heads x head_dim)."""
    params = sum(k * n * times for _, _, k, n, times in shapes(d, 1))
    return 2 * params + 4 * d["L"] * ctx * d["heads"] * d["head_dim"]


def achieved(d: dict[str, int], step: dict, rows: int) -> dict[str, float]:
    """GFLOP/s of one step's generation and update. Both phases cover every position of every sequence (prompt
    and completion: generation prefills the prompt), at the mean causal context, half the mean sequence length.
    The update is 3 forward passes (forward, backward) over the rows trained: all but `skipped_rows`, the share
    the `rl` stage left out as inert (their tokens taken as the mean). Padding and recomputation are not counted:
    this is the work's FLOPs, not the FLOPs each side executed."""
    tokens = step["prompt_tokens"] + step["tokens"]
    forward = forward_flops(d, tokens / rows / 2) * tokens
    update = 3 * forward * (1.0 - step.get("skipped_rows", 0.0))
    return {"generate": forward / step["generate"] / 1e9, "update": update / step["train"] / 1e9}


def time_mm(m: int, k: int, n: int, dtype, repeats: int = 5, least: float = 0.01) -> float:
    """Seconds of one x[m, k] @ w[n, k].T (nn.Linear's layout), the best of `repeats` runs of >= `least` s."""
    import torch

    x, w = torch.randn(m, k, dtype=dtype), torch.randn(n, k, dtype=dtype)
    out = torch.empty(m, n, dtype=dtype)

    def run(iters: int) -> float:
        start = time.perf_counter()
        for _ in range(iters):
            torch.mm(x, w.t(), out=out)
        return time.perf_counter() - start

    run(3)
    iters = 1
    while run(iters) < least:
        iters *= 2
    return min(run(iters) for _ in range(repeats)) / iters


def bound(d: dict[str, int], rows: dict[str, int]) -> dict:
    """Per phase and dtype: the FLOP-weighted GFLOP/s of the phase's shape mix, and each shape's own."""
    import torch

    out: dict = {"threads": torch.get_num_threads(), "torch": torch.__version__}
    for phase, r in rows.items():
        mix = shapes(d, r)
        per: dict = {f"{name} [{m},{k}]x[{k},{n}] x{t}": {} for name, m, k, n, t in mix}
        for dname, dtype in zip(DTYPES, (torch.float32, torch.bfloat16)):
            flops = seconds = 0.0
            for (name, m, k, n, times), key in zip(mix, per):
                s = time_mm(m, k, n, dtype)
                per[key][dname] = round(2 * m * k * n / s / 1e9, 2)
                flops, seconds = flops + 2 * m * k * n * times, seconds + s * times
            out.setdefault(phase, {})[dname] = round(flops / seconds / 1e9, 2)
        out[phase]["rows"], out[phase]["shapes"] = r, per
    return out


def measure_bound(python: str, model: Path, threads: int, rows: dict[str, int], env: dict) -> dict:
    """`bound` in a child process of `python` with `threads` threads, as the side it bounds runs."""
    cmd = [python, __file__, "bound", "--model", str(model), "--threads", str(threads),
           "--rows", *(f"{k}={v}" for k, v in rows.items())]
    done = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": str(threads)}, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"matmul bound failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=["bound"])
    parser.add_argument("--model", required=True, help="a checkpoint directory (its config.json)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", nargs="+", default=["generate=128", "update=1280"], help="phase=rows")
    args = parser.parse_args()
    import torch
    from transformers import AutoConfig

    torch.set_num_threads(args.threads)
    rows = {k: int(v) for k, _, v in (r.partition("=") for r in args.rows)}
    print(json.dumps(bound(dims(AutoConfig.from_pretrained(args.model)), rows)))


if __name__ == "__main__":
    main()
