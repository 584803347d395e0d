"""A small tmpfs mounted for one test: a disk that fills up, through mount(2) itself (no `mount` process).

    with small_tmpfs(folder, 8 << 20) as disk:   # skips the test where mounting is not permitted
        disk.fill(leave=1 << 20)                  # a filler file leaves 1 MiB free
        disk.make_room()                          # the filler removed
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
from pathlib import Path

import pytest

MNT_DETACH = 2
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _mount(target: Path, size: int) -> None:
    if _libc.mount(b"tmpfs", os.fsencode(target), b"tmpfs", 0, f"size={size}".encode()) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount tmpfs at {target}: {os.strerror(err)}")


class Tmpfs:
    """A mounted tmpfs of `size` bytes at `path`."""

    def __init__(self, path: Path, size: int):
        self.path, self.size = path, size
        self.filler = path / ".filler"

    def free(self) -> int:
        st = os.statvfs(self.path)
        return st.f_bavail * st.f_frsize

    def fill(self, leave: int) -> None:
        """Write a filler file that leaves `leave` bytes free, or a little more (it takes whole pages)."""
        take = self.free() - leave
        assert take > 0, f"only {self.free()} bytes free, asked to leave {leave}"
        with open(self.filler, "ab") as f:
            f.write(b"\0" * (take // PAGE * PAGE))

    def make_room(self) -> None:
        """Remove the filler file."""
        self.filler.unlink()


@contextlib.contextmanager
def small_tmpfs(path: Path, size: int):
    """Mount a tmpfs of `size` bytes at `path` (created when missing) for the block; always unmounted after.
    Skips the calling test where this process may not mount (not root, no CAP_SYS_ADMIN, a container's policy)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    try:
        _mount(path, size)
    except OSError as exc:
        pytest.skip(f"a full disk is simulated with a small tmpfs, and this process may not mount one ({exc})")
    try:
        yield Tmpfs(path, size)
    finally:
        if _libc.umount2(os.fsencode(path), 0) != 0:  # busy (a file left open): detach it all the same
            _libc.umount2(os.fsencode(path), MNT_DETACH)
