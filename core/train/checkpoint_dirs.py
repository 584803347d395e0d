"""A checkpoint folder's layout: one `step-NNNNNNNN` folder per checkpoint, complete once its marker is in it.

Its own module so the checkpoint writer (core/train/checkpoint.py) and its mirror on a store (core/train/checkpoint_store.py)
share it without importing each other.
"""

import re
from pathlib import Path

MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"step-(\d+)")


def step_dirs(root: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every renamed-into-place checkpoint, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found)
