"""A figure a page quotes from a committed record is held by that record: `<!-- record: PATH -->` on a page
vouches for the rest of its paragraph, or, ending one, for the next paragraph or table; every decimal number there
must equal, at the precision the page gives it, some number in the record (metrics/*.json). Markers side by side
(a table of several runs) vouch together: each figure must be in one of their records."""

import json
import re
from decimal import ROUND_HALF_EVEN, Decimal
from pathlib import Path

import pytest

from alignflow.core.fingerprint import NUMERICS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
MARKER = re.compile(r"<!--\s*record:\s*(\S+)(\s+stale)?\s*-->")
DECIMAL = re.compile(r"(?<![\w.])\d+\.\d+(?=x\b|(?![\w.]))")  # 0.738 and 1.71x, not 2.13.0, a commit or a file


def vouched(text: str, stale: bool = False) -> list[tuple]:
    """(record path, the text it vouches for) for each marker of a page, the paths of markers side by side joined
    by `+`; with `stale`, for each marker alone, also whether it says `stale` and the paragraph it stands in."""
    found, joined = [], []
    for m in MARKER.finditer(text):
        rest = text[m.end():]
        own = rest.split("\n\n", 1)[0]
        if not own.strip():  # the marker ends its paragraph: the next one (a table, usually)
            own = rest.lstrip("\n").split("\n\n", 1)[0]
        paragraph = text[:m.start()].rsplit("\n\n", 1)[-1] + rest.split("\n\n", 1)[0]
        if stale:
            found.append((m.group(1), own, bool(m.group(2)), paragraph))
        elif MARKER.match(rest.lstrip()):  # another marker follows: they vouch together for what follows it
            joined.append(m.group(1))
        else:
            found.append(("+".join([*joined, m.group(1)]), own))
            joined = []
    return found


def numbers(node) -> list[float]:
    """Every number in a parsed JSON record."""
    if isinstance(node, dict):
        return [x for v in node.values() for x in numbers(v)]
    if isinstance(node, list):
        return [x for v in node for x in numbers(v)]
    return [float(node)] if isinstance(node, (int, float)) and not isinstance(node, bool) else []


def held(figure: str, values: list[float]) -> bool:
    """Whether a page's figure is some record value rounded to the figure's decimals."""
    step = Decimal(1).scaleb(-len(figure.split(".")[1]))
    return any(Decimal(repr(v)).quantize(step, ROUND_HALF_EVEN) == Decimal(figure) for v in values)


MARKED = [(page, path, text) for page in PAGES for path, text in vouched(page.read_text())]


@pytest.mark.parametrize("page,record,text", MARKED, ids=[f"{p.name}:{r}" for p, r, _ in MARKED])
def test_every_figure_a_record_vouches_for_is_in_it(page, record, text):
    values = []
    for one in record.split("+"):
        assert (ROOT / one).is_file(), f"{page.name}: <!-- record: {one} --> names no committed file"
        values += numbers(json.loads((ROOT / one).read_text()))
    figures = DECIMAL.findall(text)
    assert figures, f"{page.name}: <!-- record: {record} --> vouches for no figure"
    missing = [f for f in figures if not held(f, values)]
    assert not missing, f"{page.name} states {', '.join(missing)}, which {record} does not hold"


STALE = [(page, path, says, paragraph) for page in PAGES
         for path, _, says, paragraph in vouched(page.read_text(), stale=True)]


@pytest.mark.parametrize("page,record,says,paragraph", STALE, ids=[f"{p.name}:{r}" for p, r, *_ in STALE])
def test_a_record_of_an_earlier_numerics_epoch_is_marked_stale_on_the_page(page, record, says, paragraph):
    """A record keeps the numerics epoch of the code that made it (NUMERICS in core/fingerprint.py, raised by a
    change that moves a stage's numbers); one from an earlier epoch, or with none, is quoted only as stale: the
    marker says `stale` and its paragraph tells the reader. A current one is not called stale."""
    epoch = json.loads((ROOT / record).read_text()).get("numerics")
    if epoch == NUMERICS:
        assert not says, f"{page.name}: {record} is of the current numerics epoch ({NUMERICS}), not stale"
    else:
        assert says and "stale" in re.sub(MARKER, "", paragraph), \
            f"{page.name}: {record} is of numerics epoch {epoch}, not {NUMERICS}: mark it `<!-- record: {record} " \
            "stale -->` and say so in its paragraph, or measure it again"


def test_the_readme_headlines_are_vouched_for():
    """A marker taken out would silence the check: the README's results keep theirs."""
    records = {record for page, record, _ in MARKED if page.name == "README.md"}
    assert {"metrics/bands/r1-tiny-avx2.json", "metrics/bands/agent-tiny.json",
            "metrics/speed/vs-trl-avx2-tiny.json"} <= records


def test_a_figure_no_record_holds_is_caught():
    text = "A table:<!-- record: x -->\n\n| a | 0.738 |\n| b | 0.7 |\n\nnot this 0.5\n"
    assert DECIMAL.findall("1.71x TRL's, torch 2.13.0, `8ed44e3`, r1-tiny-avx2.json, 0.5") == ["1.71", "0.5"]
    (record, block), = vouched(text)
    assert block == "| a | 0.738 |\n| b | 0.7 |" and DECIMAL.findall(block) == ["0.738", "0.7"]
    assert held("0.738", [0.738]) and held("0.77", [0.7733333333333333]) and held("0.7", [0.6833])
    assert not held("0.684", [0.6833333333333335]) and not held("0.75", [0.738])


def test_markers_side_by_side_vouch_together_for_what_follows():
    text = "Runs: <!-- record: a.json --> <!-- record: b.json -->\n\n| x | 1.5 | 2.5 |\n\nafter <!-- record: c.json --> 3.5"
    assert vouched(text) == [("a.json+b.json", "| x | 1.5 | 2.5 |"), ("c.json", " 3.5")]
    assert [path for path, *_ in vouched(text, stale=True)] == ["a.json", "b.json", "c.json"]
