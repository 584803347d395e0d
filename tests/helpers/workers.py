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
