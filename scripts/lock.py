"""Write requirements/lock-cpu.txt: the exact version of every package in this development environment.

Run it deliberately, in a fresh environment installed the README's way with the CPU build of torch, when the
published results are measured again on new library versions, and add a changelog line saying so:

    python scripts/lock.py            # rewrite the lock, print what moved
    python scripts/lock.py --check    # exit 1 when this environment differs from the lock (writes nothing)

The lock is a pip constraints file (`pip install -c requirements/lock-cpu.txt -e ".[dev]"`): it pins what gets
installed without installing anything by itself, so a package the install does not need is never pulled in.
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / "requirements" / "lock-cpu.txt"
PROJECT = "alignflow"
HEADER = """\
# The exact versions behind the published results: `pip freeze` of a development environment (`.[dev]`) with
# the CPU build of torch, less alignflow itself. Written by `python scripts/lock.py` (never by hand); taken on
# CPython {python} on {machine}. A constraints file, so install with it as:
#   pip install -c requirements/lock-cpu.txt -e ".[dev]"
# Local version labels are dropped (torch==2.13.0 matches the +cpu build and the CUDA one alike).
# `alignflow doctor` compares an environment with it.
"""


def frozen() -> dict[str, str]:
    """{name: version} of every installed distribution but this project, from `pip freeze`."""
    done = subprocess.run([sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
                          capture_output=True, text=True, check=True)
    pins = {}
    for line in done.stdout.splitlines():
        name, sep, version = line.strip().partition("==")
        if not sep:  # `name @ URL` or a comment: not something another machine can install
            if line.strip() and not line.startswith("#"):
                sys.exit(f"pip freeze: {line!r} is not name==version; install it from an index, then lock")
            continue
        if normal(name) != PROJECT:
            pins[name] = version.split("+")[0]
    return pins


def normal(name: str) -> str:
    """A distribution name as PEP 503 compares it."""
    return name.lower().replace("_", "-").replace(".", "-")


def read_lock(path: Path = LOCK) -> dict[str, str]:
    """{name: version} of a lock file's `name==version` lines."""
    pins = {}
    for line in path.read_text().splitlines():
        name, sep, version = line.split("#")[0].strip().partition("==")
        if sep:
            pins[name.strip()] = version.strip()
    return pins


def moved(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """One line per package added, removed or moved between two locks."""
    a, b = {normal(k): v for k, v in old.items()}, {normal(k): v for k, v in new.items()}
    return [f"{k}: {a.get(k, '-')} -> {b.get(k, '-')}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 when something moved")
    args = parser.parse_args()
    pins = frozen()
    if not any(normal(k) == "torch" for k in pins):
        sys.exit("torch is not installed: install it and the project (`.[dev]`) first")
    cuda = sorted(k for k in pins if normal(k).startswith("nvidia-"))
    if cuda:
        sys.exit(f"this environment has CUDA packages ({', '.join(cuda[:3])}, ...): lock one with the CPU build")
    broken = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    if broken.returncode != 0:
        sys.exit(f"pip check fails, so this environment is no lock:\n{broken.stdout}")
    changes = moved(read_lock() if LOCK.is_file() else {}, pins)
    print("\n".join(changes) or "no change", file=sys.stderr)
    if args.check:
        return 1 if changes else 0
    LOCK.parent.mkdir(exist_ok=True)
    text = HEADER.format(python=platform.python_version(), machine=f"{platform.system()} {platform.machine()}")
    LOCK.write_text(text + "".join(f"{k}=={v}\n" for k, v in sorted(pins.items(), key=lambda kv: normal(kv[0]))))
    print(f"{LOCK.relative_to(ROOT)}: {len(pins)} packages; add a changelog line (docs/changelog.md)",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
