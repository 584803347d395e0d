"""glibc's malloc in a CPU training or sampling process: freed memory kept for reuse, not handed back to the kernel.

By default glibc serves a block over its mmap threshold (128 KB at start, raised as such blocks are freed) with
fresh pages from the kernel, and gives back free memory at the top of its heap beyond its trim threshold. A training
step frees and reallocates the same activation shapes in every micro-batch, so on a CPU many of them come back as new
pages, each one a page fault (the kernel maps and zeroes it) on first touch: thousands a step. `keep_freed_memory`
sets both thresholds with `mallopt`, so blocks up to MMAP_THRESHOLD come from the heap and up to TRIM_THRESHOLD of
free memory stays mapped for the next micro-batch. It is what preloading tcmalloc or jemalloc does for a CPU run
(torch's own `torch.backends.xeon.run_cpu` launcher offers both), without a preload.

Peak memory is unchanged in principle (the same blocks are live at the peak); memory freed after a peak stays
with the process until it exits. Where the C library is not glibc, nothing changes.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 32 << 20  # the most glibc accepts on 64-bit: larger blocks are still mapped on their own
TRIM_THRESHOLD = 512 << 20


@functools.cache
def keep_freed_memory() -> bool:
    """Set glibc's thresholds once per process; whether they are set (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        version = libc.gnu_get_libc_version  # only glibc has it (musl's mallopt does nothing)
    except (OSError, AttributeError):
        return False
    version.restype = ctypes.c_char_p
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("glibc %s: malloc keeps freed memory (%s)", version().decode(), "set" if ok else "refused")
    return ok
