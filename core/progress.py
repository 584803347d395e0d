"""Progress of a training or generation loop: a live bar on a terminal, log lines elsewhere.

    with progress("sft", total=engine.total_steps, initial=engine.step_count) as bar:
        for step in engine.steps():
            ...
            bar.update(loss=loss, lr=metrics["lr"], tokens=num_tokens)

On a terminal tqdm draws step, metrics, throughput and ETA; when the stream is not a terminal
(a Prefect worker, a CI log, a pipe) the same line goes to the `alignflow.progress` logger every
`log_every` steps and at the end. Only rank 0 of a distributed run reports.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import IO

import torch.distributed as dist
from tqdm import tqdm

log = logging.getLogger("alignflow.progress")


def _duration(seconds: float) -> str:
    return str(timedelta(seconds=round(seconds))) if math.isfinite(seconds) else "?"


class Progress:
    """Counts steps, tokens and the latest metrics of one loop, and reports them."""

    def __init__(self, name: str, total: int, initial: int, log_every: int | None, unit: str, stream: IO):
        self.name, self.total, self.unit = name, total, unit
        self.initial = self.n = self._logged = initial  # a resumed loop's rate and ETA count only new steps
        self.tokens = 0
        self.metrics: dict[str, float] = {}
        self.start = time.perf_counter()
        self.log_every = log_every or max(1, total // 20)
        self.enabled = not (dist.is_initialized() and dist.get_rank() != 0)
        self.bar = None
        if self.enabled and stream.isatty():
            self.bar = tqdm(total=total, initial=initial, desc=name, unit=unit, file=stream, dynamic_ncols=True)

    def update(self, n: int = 1, *, tokens: int = 0, **metrics: float) -> None:
        """Advance by `n` steps that processed `tokens` tokens; `metrics` replace the shown values."""
        self.n += n
        self.tokens += tokens
        self.metrics.update({k: float(v) for k, v in metrics.items()})
        if self.bar is not None:
            self.bar.set_postfix_str(self._postfix(), refresh=False)
            self.bar.update(n)
        elif self.enabled and (self.n - self._logged >= self.log_every or self.n >= self.total):
            self._logged = self.n
            log.info(self.line())

    def _postfix(self) -> str:
        shown = [f"{k}={v:.4g}" for k, v in self.metrics.items()]
        elapsed = time.perf_counter() - self.start
        if self.tokens:
            shown.append(f"{self.tokens / max(elapsed, 1e-9):,.0f} tok/s")
        return " ".join(shown)

    def line(self) -> str:
        """`name n/total [pct] metrics | rate | elapsed, eta` for a log."""
        elapsed = time.perf_counter() - self.start
        rate = (self.n - self.initial) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.n) / rate if rate > 0 else float("inf")
        pct = 100 * self.n / self.total if self.total else 100.0
        return (
            f"{self.name} {self.n}/{self.total} [{pct:.0f}%] {self._postfix()} | {rate:.3g} {self.unit}/s"
            f" | elapsed {_duration(elapsed)} eta {_duration(eta)}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@contextmanager
def progress(
    name: str,
    total: int,
    *,
    initial: int = 0,
    log_every: int | None = None,
    unit: str = "step",
    stream: IO | None = None,
) -> Iterator[Progress]:
    """Report a loop of `total` steps (starting at `initial` when resumed); logs about 20 lines by default."""
    bar = Progress(name, total, initial, log_every, unit, stream or sys.stderr)
    try:
        yield bar
    finally:
        bar.close()
