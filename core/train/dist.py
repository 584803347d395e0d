"""Where this process stands in a data-parallel process group, and gathering plain objects over it."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the number of ranks: (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def gathered(obj: Any) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank: [obj] on one process. All ranks call it."""
    world = rank_and_world()[1]
    if world == 1:
        return [obj]
    parts: list = [None] * world
    dist.all_gather_object(parts, obj)
    return parts
