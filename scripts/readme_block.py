"""Print a marked fenced block of README.md, so CI runs the README's own commands: `python scripts/readme_block.py
project-install` prints the block between `<!-- project-install ... -->` and `<!-- /project-install -->`."""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def block(text: str, name: str) -> str:
    """The body of the one fenced block between the markers `<!-- NAME ... -->` and `<!-- /NAME -->`."""
    marked = re.findall(rf"<!-- {re.escape(name)}\b[^>]*-->\n(.*?)<!-- /{re.escape(name)} -->", text, re.S)
    if len(marked) != 1:
        raise ValueError(f"README.md: expected one block marked <!-- {name} -->, found {len(marked)}")
    fenced = re.fullmatch(r"\s*```bash\n(.*?)```\s*", marked[0], re.S)
    if fenced is None:
        raise ValueError(f"README.md: the block marked <!-- {name} --> is not one ```bash fenced block")
    return fenced.group(1)


def main() -> int:
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        print(block(README.read_text(), sys.argv[1]), end="")
    except ValueError as exc:
        sys.exit(str(exc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
