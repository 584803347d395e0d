"""A machine under load, for tests whose result must not depend on an idle machine: busy loops beside the test."""

import contextlib
import subprocess
import sys
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def busy_loops(n: int) -> Iterator[None]:
    """`n` processes spinning on a core each until the block ends."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for p in loops:
            p.kill()
            p.wait()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """`n` intra-op threads for the block: a reduction split across threads is what load can reorder."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
