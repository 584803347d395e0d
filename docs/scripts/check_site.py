"""What a strict build does not catch, read from the built HTML: a Markdown table that did not parse (its rows
left as `| ... |` text in a paragraph) and a code block too wide for a 1280 px window.

    mkdocs build --strict --site-dir DIR && python docs/scripts/check_site.py DIR
"""

from __future__ import annotations

import sys
from html.parser import HTMLParser
from pathlib import Path

# At 1280 px, beside both sidebars, mkdocs-material's content column is about 690 px: about 80 columns of its
# 13.6 px code font. docs/stylesheets/extra.css wraps longer code lines instead of hiding their end; a line
# may wrap once (110 columns), and a text block (help, a tree), which a wrap would garble, not at all.
MAX_CODE_COLUMNS = 110
MAX_TEXT_COLUMNS = 80


class _Scan(HTMLParser):
    """Collects the text of each <p>, and of each <pre> outside Mermaid diagrams with its language."""

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.paragraphs: list[str] = []
        self.pres: list[tuple[str, str]] = []  # (language, text)
        self._open: list[tuple[str, list[str]]] = []  # (tag, text parts) of the <p>/<pre> being read
        self._language = ""  # of the last `<div class="language-X highlight">`, which holds the next <pre>

    def handle_starttag(self, tag, attrs):
        classes = (dict(attrs).get("class") or "").split()
        if tag == "div":
            self._language = next((c[len("language-"):] for c in classes if c.startswith("language-")),
                                  self._language)
        if tag in ("p", "pre"):
            self._open.append((tag if "mermaid" not in classes else "skip", []))

    def handle_endtag(self, tag):
        if tag in ("p", "pre") and self._open:
            kind, parts = self._open.pop()
            text = "".join(parts)
            if kind == "p":
                self.paragraphs.append(text)
            elif kind == "pre":
                self.pres.append((self._language, text))
                self._language = ""
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
        out += [f"a table row left as text: {row.strip()[:80]}" for row in text.splitlines() if _row(row)]
    for language, text in scan.pres:
        most = MAX_TEXT_COLUMNS if language == "text" else max_columns
        wide = [line for line in text.splitlines() if len(line) > most]
        out += [f"a {language or 'code'} line of {len(line)} characters (at most {most}): {line[:60]}..."
                for line in wide]
    return out


def _row(line: str) -> bool:
    """A Markdown table row, `| a | b |`, rather than text that starts with an absolute value `|x|`."""
    line = line.strip()
    return line.startswith("|") and line.endswith("|") and line.count("|") >= 3


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
