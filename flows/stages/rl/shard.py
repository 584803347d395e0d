"""Data-parallel ranks in an `rl` update: which micro-batches this rank computes, and the gathering of every
rank's results, behind one helper so the update loop reads as one process's."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.distributed as dist
from torch import Tensor

from alignflow.core.train.dist import gathered, rank_and_world


@dataclass(frozen=True)
class Shard:
    """This process's place among the ranks: it takes every `world`-th micro-batch from `rank` on."""

    rank: int = 0
    world: int = 1

    @classmethod
    def current(cls) -> "Shard":
        return cls(*rank_and_world())

    def mine(self, micro: list[Tensor]) -> list[Tensor]:
        """This rank's share of a list of micro-batches."""
        return micro[self.rank::self.world]

    def idle(self, micro: list[Tensor]) -> bool:
        """Whether this rank has no share of a non-empty list: it must still join the optimizer step's
        all-reduce, with one micro-batch at weight 0."""
        return bool(micro) and not self.mine(micro)

    def sum(self, t: Tensor) -> Tensor:
        """`t` summed over the ranks, in place (each rank's part is zero where another's is not)."""
        if self.world > 1:
            dist.all_reduce(t)
        return t

    def merge(self, micro_metrics: dict[str, list[float]], step_losses: list[float]):
        """Every rank's micro-batch metrics, and each step's loss summed over the ranks' shares."""
        if self.world == 1:
            return micro_metrics, step_losses
        parts = gathered((dict(micro_metrics), step_losses))
        merged: dict[str, list[float]] = defaultdict(list)
        for metrics, _ in parts:
            for k, v in metrics.items():
                merged[k] += v
        return merged, [sum(losses) for losses in zip(*(p[1] for p in parts))]
