"""The installed plugins with a test's own plugin added for as long as the test module needs it."""

from collections.abc import Iterator
from contextlib import contextmanager

from alignflow.core.plugins import Plugins, get_plugins


@contextmanager
def registered(plugin, name: str) -> Iterator[Plugins]:
    """`get_plugins()` with `plugin` (a class or module of hookimpls) added as `name`, removed afterwards."""
    plugins = get_plugins()
    plugins.add(plugin, name)
    try:
        yield plugins
    finally:
        plugins.remove(name)
