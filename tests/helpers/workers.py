"""How `pytest -n N --dist loadgroup` (pytest-xdist) shares the suite between workers (tests/conftest.py applies it).

A module-scoped fixture is built once in every worker that runs one of its module's tests: a module whose tests
share a fixture of its own (a pipeline run, a server, trained weights) is kept on one worker, in order, as an
`xdist_group` named after the module. Other tests go to whichever worker is free, one at a time.
"""

import pytest

SHARED_SCOPES = {"module", "class", "package"}


def shares_own_fixture(item) -> bool:
    """Whether a test uses a module-, class- or package-scoped fixture its own module defines."""
    info = getattr(item, "_fixtureinfo", None)
    module_id = item.nodeid.split("::")[0]
    return info is not None and any(
        defs[-1].scope in SHARED_SCOPES and defs[-1].baseid.split("::")[0] == module_id
        for defs in info.name2fixturedefs.values() if defs)


def group_by_module(item) -> None:
    """Put a test that shares its module's fixtures in its module's group (a test's own group mark wins)."""
    if not item.get_closest_marker("xdist_group") and shares_own_fixture(item):
        item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))


def name_groups(items) -> None:
    """Under `--dist loadgroup`, after pytest-xdist's own collection hook: give each grouped test the id
    `nodeid@group` the scheduler reads. xdist 3.8 writes it into `item._nodeid`, which pytest 9 no longer reads
    (its ids are structured), so without this every group is ignored and each worker builds a module's fixtures
    again (pytest-dev/pytest-xdist#1386); on a pytest that still reads `_nodeid` the id already ends so."""
    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix) and hasattr(item, "_id"):
            from _pytest.nodeid import NodeId

            item._id = NodeId.parse(item.nodeid + suffix)  # keeps the string it parsed as the node's id
