"""Every ```python block of README.md, CONTRIBUTING.md and docs/ runs, each as a fresh module.

A block whose first line starts with `# docs: no-run` is skipped: only for code that needs a GPU or the network, or
that trains models which a named test already runs.
The blocks of docs/concepts/contracts.md are also checked in depth by test_contracts_doc.py.
"""

import re
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NO_RUN = "# docs: no-run"
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]


def python_blocks():
    for page in PAGES:
        for i, block in enumerate(re.findall(r"^```python\n(.*?)^```$", page.read_text(), re.S | re.M)):
            yield pytest.param(page, block, id=f"{page.relative_to(ROOT)}:{i}")


BLOCKS = list(python_blocks())


@pytest.mark.parametrize("page, block", BLOCKS)
def test_python_block_runs(page, block, monkeypatch):
    if block.startswith(NO_RUN):
        pytest.skip(block.splitlines()[0])
    name = f"docs_block_{abs(hash((str(page), block)))}"
    module = types.ModuleType(name)
    monkeypatch.setitem(sys.modules, name, module)  # pydantic, dataclasses and plugins resolve through it
    exec(compile(block, f"{page}:python block", "exec"), module.__dict__)


def test_every_page_with_code_is_found():
    """The README and the plugin guides hold runnable examples; a renamed folder must not silence them."""
    pages = {page.relative_to(ROOT).as_posix() for page, _ in (p.values for p in BLOCKS)}
    for expected in ("README.md", "docs/guides/plugins/rewards.md", "docs/guides/plugins/algorithms.md",
                     "docs/guides/plugins/samplers.md", "docs/guides/plugins/selectors.md"):
        assert expected in pages, expected
    assert sum(block.startswith(NO_RUN) for _, block in (p.values for p in BLOCKS)) <= 3


def pipeline_blocks():
    for page in PAGES:
        for i, block in enumerate(re.findall(r"^```yaml\n(name: .*?)^```$", page.read_text(), re.S | re.M)):
            yield pytest.param(page, block, id=f"{page.relative_to(ROOT)}:yaml{i}")


@pytest.mark.parametrize("page, block", list(pipeline_blocks()))
def test_pipeline_example_validates(page, block):
    """A whole pipeline shown in the docs parses, with its plugins and settings checked."""
    import yaml

    from alignflow.core.spec.schema import parse_spec

    spec = parse_spec(yaml.safe_load(block), f"{page}:yaml")
    assert spec.order()


def test_readme_links_reach_the_guides_and_results():
    """The README is the front door: its links resolve, and each plugin guide and the results are one click away."""
    links = re.findall(r"\]\(([^)#]+)\)", (ROOT / "README.md").read_text())
    local = [link for link in links if "://" not in link]
    assert all((ROOT / link).is_file() for link in local), [link for link in local if not (ROOT / link).is_file()]
    for page in ("docs/results/index.md", "docs/getting-started.md", "docs/guides/plugins/algorithms.md",
                 "docs/guides/plugins/rewards.md", "docs/guides/plugins/samplers.md",
                 "docs/guides/plugins/selectors.md", "CONTRIBUTING.md"):
        assert page in local, page
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150
