"""`alignflow.core` is the one module a plugin imports from: every name that the plugin docs and the example
package import, and every capability and shared RL part the contracts page lists, is there."""

import ast
import re
from pathlib import Path

import pytest

import alignflow.core as core

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs/guides/plugins").glob("*.md")), ROOT / "docs/concepts/contracts.md",
         ROOT / "docs/guides/environments.md", ROOT / "docs/guides/served-environments.md"]
EXAMPLES = sorted(p for p in (ROOT / "examples").rglob("*.py")  # not a copy a package build left behind
                  if not {"build", "dist"} & set(p.relative_to(ROOT).parts))


def imports_from_core(source: str, where: str) -> list[tuple[str, str, str]]:
    """(where, module, name) for each `from alignflow.core... import name` of `source`."""
    return [(where, node.module, a.name) for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("alignflow.core") for a in node.names]


def documented_imports() -> list[tuple[str, str, str]]:
    found = []
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            found += imports_from_core(block, page.name)
    for path in EXAMPLES:
        found += imports_from_core(path.read_text(), path.name)
    return found


def test_the_docs_and_the_example_import_every_plugin_name_from_alignflow_core():
    found = documented_imports()
    assert {name for *_, name in found} >= {"Environment", "Step", "Turn", "PluginConfig", "hookimpl", "Scores",
                                           "PolicyGradient", "PreferenceAlgorithm", "Sampler", "Selector"}
    assert [f"{where}: {module}" for where, module, _ in found if module != "alignflow.core"] == []
    assert [f"{where}: {name}" for where, _, name in found if name not in core.__all__] == []


def test_the_listed_capabilities_and_shared_parts_are_in_alignflow_core():
    rows = [line.split("|")[1] for line in (ROOT / "docs/concepts/contracts.md").read_text().splitlines()
            if line.startswith("| `")]
    names = {m for cell in rows for m in re.findall(r"`(?:\w+\.)*(\w+)", cell)}
    assert {"Regenerate", "EpisodeTurns", "clipped_surrogate", "gae", "broadcast", "aggregate"} <= names
    assert sorted(names - set(core.__all__)) == []


@pytest.mark.parametrize("name", sorted(core.__all__))
def test_each_export_is_the_object_where_it_is_defined(name):
    value = getattr(core, name)
    module = getattr(value, "__module__", None)
    if module and module.startswith("alignflow.core.") and hasattr(value, "__qualname__"):
        assert getattr(__import__(module, fromlist=["_"]), value.__qualname__) is value
