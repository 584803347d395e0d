"""Loads plugins from the `alignflow` entry-point group into one registry per kind."""

from __future__ import annotations

import importlib.metadata as md
import os
from functools import lru_cache

import pluggy

from alignflow.core import hookspecs
from alignflow.core.errors import PluginError
from alignflow.core.registry import Entry, Registry

GROUP = "alignflow"
KINDS = {  # hook name -> registry kind
    "register_algorithms": "algorithm",
    "register_rewards": "reward",
    "register_samplers": "sampler",
    "register_selectors": "selector",
    "register_environments": "environment",
}


class Plugins:
    """The loaded plugins: a pluggy manager plus `algorithms`, `rewards`, `samplers`, `selectors`, `environments`."""

    def __init__(self):
        self.pm = pluggy.PluginManager(GROUP)
        self.pm.add_hookspecs(hookspecs)
        self.origin: dict[str, tuple[str, str, str]] = {}  # plugin name -> (dist, version, entry point)
        self.registries = {kind: Registry(kind) for kind in KINDS.values()}

    algorithms = property(lambda self: self.registries["algorithm"])
    rewards = property(lambda self: self.registries["reward"])
    samplers = property(lambda self: self.registries["sampler"])
    selectors = property(lambda self: self.registries["selector"])
    environments = property(lambda self: self.registries["environment"])

    def add(self, plugin, name: str, distribution: str = "__main__", version: str = "0") -> None:
        """Register one plugin object (a module or class with hookimpls) and collect what it registers."""
        where = f"{distribution} (entry point {name!r})"
        try:
            self.pm.register(plugin, name=name)
            self.pm.check_pending()
        except pluggy.PluginValidationError as exc:
            self.pm.unregister(name=name)
            detail = "; ".join(line.strip() for line in str(exc).splitlines() if line.strip())
            raise PluginError(f"plugin {where} has an invalid hook implementation: {detail}") from exc
        self.origin[name] = (distribution, version, name)
        for hook_name, kind in KINDS.items():
            for impl in getattr(self.pm.hook, hook_name).get_hookimpls():
                if impl.plugin is plugin:
                    impl.function(register=self._registrar(kind, distribution, version, name))

    def remove(self, name: str) -> None:
        """Unregister a plugin and everything it registered (tests use this in teardown)."""
        self.pm.unregister(name=name)
        self.origin.pop(name, None)
        for registry in self.registries.values():
            for entry in list(registry):
                if entry.entry_point == name:
                    registry.remove(entry.name)

    def _registrar(self, kind: str, distribution: str, version: str, entry_point: str):
        registry = self.registries[kind]

        def register(name: str, obj) -> None:
            registry.add(Entry(kind, name, obj, distribution, version, entry_point))

        return register

    def entries(self) -> list[Entry]:
        return [entry for registry in self.registries.values() for entry in registry]


def _wanted(ep: md.EntryPoint) -> bool:
    only = os.environ.get("ALIGNFLOW_PLUGINS")
    if only is None:
        return True
    names = {n.strip() for n in only.split(",") if n.strip()}
    dist = ep.dist.name if ep.dist is not None else ""
    return ep.name in names or dist in names


def entry_point_names() -> set[str]:
    """Names of the wanted entry points: what `get_plugins()` loads in a fresh process."""
    return {ep.name for ep in md.entry_points(group=GROUP) if _wanted(ep)}


def load_entry_points(plugins: Plugins) -> None:
    """Import every wanted entry point of the group; a failure names the distribution and entry point."""
    for ep in sorted(md.entry_points(group=GROUP), key=lambda e: (e.dist.name if e.dist else "", e.name)):
        if not _wanted(ep):
            continue
        dist = ep.dist.name if ep.dist is not None else "unknown distribution"
        version = ep.dist.version if ep.dist is not None else "0"
        try:
            module = ep.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {dist} (entry point {ep.name!r} = {ep.value!r}) failed to import: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        plugins.add(module, ep.name, dist, version)


@lru_cache(maxsize=1)
def get_plugins() -> Plugins:
    """The process-wide plugins, loaded once from entry points."""
    plugins = Plugins()
    load_entry_points(plugins)
    return plugins


def reset_plugins() -> None:
    """Forget the loaded plugins (after ALIGNFLOW_PLUGINS changes, or in tests)."""
    get_plugins.cache_clear()
