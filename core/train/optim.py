"""What a stage's training settings give DeepSpeed (core/train/engine.py): its config, optimizer and LR schedule."""

from __future__ import annotations

import math
from typing import Any

import torch

from alignflow.core.errors import AlignflowError
from alignflow.core.spec.settings import TrainSettings


def lr_lambda(kind: str, total_steps: int, warmup_ratio: float):
    """The LR multiplier at step s: linear warmup from 1/(w+1), then constant, linear or cosine to 0."""
    warmup = math.ceil(warmup_ratio * total_steps)

    def factor(s: int) -> float:
        if s < warmup:
            return (s + 1) / (warmup + 1)
        progress = min(1.0, (s - warmup) / max(1, total_steps - warmup))
        if kind == "linear":
            return 1.0 - progress
        if kind == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return factor


def ds_config(settings: TrainSettings, world_size: int, num_params: int) -> dict[str, Any]:
    """The DeepSpeed config for these settings; errors name the fields that do not divide."""
    per_step = settings.micro_batch_size * world_size
    if settings.batch_size % per_step:
        raise AlignflowError(
            f"batch_size={settings.batch_size} must be a multiple of micro_batch_size={settings.micro_batch_size} "
            f"x world size {world_size}"
        )
    return {
        "train_batch_size": settings.batch_size,
        "train_micro_batch_size_per_gpu": settings.micro_batch_size,
        "gradient_accumulation_steps": settings.batch_size // per_step,
        # the loop, not a micro-step counter, decides when a step ends (RL steps vary in micro-batches)
        "managed_gradient_accumulation": False,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage, **_buckets(num_params), **_offload(settings)},
        "bf16": {"enabled": settings.precision == "bf16"},  # bf16-mixed: fp32 here, autocast in the forwards
        "steps_per_print": 2**31 - 1,
        "zero_allow_untested_optimizer": True,  # torch's own AdamW and SGD, which ZeRO wraps like any other
        # Offloaded, torch's optimizer steps the CPU-held fp32 partitions: DeepSpeed refuses a client
        # optimizer there by default (its DeepSpeedCPUAdam is faster but a JIT-compiled op a CPU install may lack)
        "zero_force_ds_cpu_optimizer": False,
    }


def _offload(settings: TrainSettings) -> dict[str, Any]:
    """ZeRO-Offload's placement: `offload_optimizer`, and at ZeRO-3 `offload_param` (TrainSettings refuses the
    combinations DeepSpeed cannot run). Pinned host memory makes the GPU<->CPU copies asynchronous; DeepSpeed's
    CPU accelerator ignores it."""
    placed = {}
    if settings.offload_optimizer != "none":
        placed["offload_optimizer"] = {"device": settings.offload_optimizer, "pin_memory": True}
    if settings.offload_params != "none":
        placed["offload_param"] = {"device": settings.offload_params, "pin_memory": True}
    return placed


def _buckets(num_params: int) -> dict[str, int]:
    """ZeRO's communication buffers, no larger than the model.

    DeepSpeed's defaults (5e8 elements, 2 GB in fp32) are sized for large models on GPUs; for a
    small model they only cost allocation time (seconds on a CPU) and memory.
    """
    size = min(int(5e8), max(num_params, 1))
    return {"reduce_bucket_size": size, "allgather_bucket_size": size, "stage3_prefetch_bucket_size": size}


def optimizer_for(model: torch.nn.Module, settings: TrainSettings) -> torch.optim.Optimizer:
    """AdamW (or SGD) without decay on biases and norm gains (tensors under two dimensions)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": settings.weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    groups = [g for g in groups if g["params"]]
    if settings.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=settings.lr, momentum=settings.momentum)
    # torch's own AdamW (DeepSpeed's fused/CPU Adam need compiled ops that a CPU install may lack), in its fused
    # kernel: one op for all tensors where the default on a CPU loops over them, ~10 ops each (one step of the
    # 8M model: 4 ms against 24 on one core)
    return torch.optim.AdamW(groups, lr=settings.lr, fused=True)
