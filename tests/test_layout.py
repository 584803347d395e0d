"""The source tree's layout rules: core never imports flows, no import cycles, small files, every plugin module
reachable through an entry point, and pyproject's package list equal to the package folders."""

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("core", "flows", "plugins")
MAX_LINES = 400


def _module(path: Path) -> str:
    parts = ["alignflow", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


SOURCES = {_module(p): p for layer in LAYERS for p in sorted((ROOT / layer).rglob("*.py"))}


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path) -> set[str]:
    """Every alignflow module `path` imports, at the top or inside a function (not under TYPE_CHECKING)."""
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.ImportFrom) and child.module and child.level == 0:
                for name in [child.module] + [f"{child.module}.{a.name}" for a in child.names]:
                    if name in SOURCES:
                        found.add(name)
            elif isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in SOURCES)
            visit(child)

    visit(ast.parse(path.read_text()))
    return found


GRAPH = {name: _imports(path) - {name} for name, path in SOURCES.items()}


def test_core_never_imports_flows():
    bad = sorted(f"{m} imports {t}" for m, ts in GRAPH.items() if m.startswith("alignflow.core")
                 for t in ts if t.startswith("alignflow.flows"))
    assert not bad, "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]; counter[0] += 1; stack.append(root); on.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]; counter[0] += 1; stack.append(child); on.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop(); on.discard(m); scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    out.append(sorted(scc))
    return out


def test_import_graph_is_acyclic():
    """Imports inside functions count too: a cycle hidden in a function is still a cycle."""
    # a package's __init__ that re-exports its submodules is not a cycle of the code
    graph = {m: {t for t in ts if not (m + ".").startswith(t + ".")} for m, ts in GRAPH.items()}
    assert _cycles(graph) == []


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("name", sorted(SOURCES))
def test_no_source_file_over_400_lines(name):
    lines = SOURCES[name].read_text().count("\n")
    assert lines <= MAX_LINES, f"{SOURCES[name].relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def _wide_functions(tree: ast.AST, most: int) -> list[str]:
    """`name (count)` of each function taking more than `most` parameters, positional and keyword-only (not self,
    cls, *args or **kwargs)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            n = len([x for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls")])
            if n > most:
                out.append(f"{node.name}:{node.lineno} ({n})")
    return out


def test_rl_stage_functions_take_at_most_7_parameters():
    """The rl stage passes its `Parts` or a record built once in `build`, not loose values from call to call."""
    wide = {str(p.relative_to(ROOT)): found for p in sorted((ROOT / "flows/stages/rl").glob("*.py"))
            if (found := _wide_functions(ast.parse(p.read_text()), 7))}
    assert wide == {}


def test_the_parameter_count_counts_keyword_only_and_not_self():
    tree = ast.parse("class A:\n def f(self, a, b, *rest, c, d=1, **kw): pass\ndef g(a, /, b): pass")
    assert _wide_functions(tree, 3) == ["f:2 (4)"] and _wide_functions(tree, 4) == []


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_hookimpl_module_has_an_entry_point():
    """A built-in plugin loads only through its entry point: a module that implements hooks but is not listed
    under [project.entry-points.alignflow] is never loaded."""
    points = set(_pyproject()["project"]["entry-points"]["alignflow"].values())
    missing = sorted(name for name, path in SOURCES.items()
                     if name.startswith("alignflow.plugins.") and "@hookimpl" in path.read_text() and name not in points)
    assert not missing, f"modules with a hookimpl but no entry point in pyproject.toml: {missing}"


def test_entry_points_name_existing_modules():
    points = _pyproject()["project"]["entry-points"]["alignflow"]
    assert {k: v for k, v in points.items() if v not in SOURCES} == {}


def test_package_list_equals_package_folders():
    declared = set(_pyproject()["tool"]["setuptools"]["packages"])
    folders = {_module(p) for layer in LAYERS for p in (ROOT / layer).rglob("__init__.py")}
    assert declared == folders
