"""What a strict build does not catch, read from the built HTML: a Markdown table that did not parse (its rows
left as `| ... |` text in a paragraph) and a code block too wide for a 1280 px window.

    mkdocs build --strict --site-dir DIR && python docs/scripts/check_site.py DIR
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

# Characters of a code line that fit in the content column of mkdocs-material at 1280 px (about 110 at its
# code font size); a longer line scrolls sideways, its end out of sight.
MAX_CODE_COLUMNS = 110


class _Scan(HTMLParser):
    """Collects the text of each <p> and each <pre> outside Mermaid diagrams."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.pres: list[str] = []
        self._open: list[tuple[str, list[str]]] = []  # (tag, text parts) of the <p>/<pre> being read

    def handle_starttag(self, tag, attrs):
        if tag in ("p", "pre"):
            classes = (dict(attrs).get("class") or "").split()
            self._open.append((tag if "mermaid" not in classes else "skip", []))

    def handle_endtag(self, tag):
        if tag in ("p", "pre") and self._open:
            kind, parts = self._open.pop()
            text = "".join(parts)
            if kind == "p":
                self.paragraphs.append(text)
            elif kind == "pre":
                self.pres.append(text)
            if self._open:  # a <p> inside a <pre> (never) or the reverse: keep the text for the outer one
                self._open[-1][1].append(text)

    def handle_data(self, data):
        if self._open:
            self._open[-1][1].append(data)


def problems(html: str, max_columns: int = MAX_CODE_COLUMNS) -> list[str]:
    """Raw table rows in paragraphs, and code lines wider than `max_columns`, of one page's HTML."""
    scan = _Scan()
    scan.feed(html)
    out = []
    for text in scan.paragraphs:
        rows = [line for line in text.splitlines() if line.lstrip().startswith("|")]
        out += [f"a table row left as text: {row.strip()[:80]}" for row in rows]
    for text in scan.pres:
        wide = [line for line in text.splitlines() if len(line) > max_columns]
        out += [f"a code line of {len(line)} characters (at most {max_columns}): {line[:60]}..." for line in wide]
    return out


def site_problems(site: Path) -> dict[str, list[str]]:
    """{page (relative to the site): its problems} for every page of a built site that has some."""
    found = {}
    for page in sorted(site.rglob("*.html")):
        if page.name == "404.html":
            continue
        bad = problems(page.read_text(encoding="utf-8"))
        if bad:
            found[page.relative_to(site).as_posix()] = bad
    return found


if __name__ == "__main__":
    found = site_problems(Path(sys.argv[1]))
    for page, bad in found.items():
        print(page)
        print("\n".join(f"  {line}" for line in bad))
    sys.exit(1 if found else 0)
