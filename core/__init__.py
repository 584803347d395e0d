"""alignflow.core: contracts and machinery; no algorithm lives here."""

from alignflow.core.contracts import Algorithm, PluginConfig, Sampler, Selector, operational
from alignflow.core.errors import AlignflowError, DataError, PluginError, SpecError
from alignflow.core.hookspecs import hookimpl, hookspec
from alignflow.core.plugins import get_plugins, reset_plugins

__all__ = [
    "Algorithm", "PluginConfig", "Sampler", "Selector", "operational",
    "AlignflowError", "DataError", "PluginError", "SpecError",
    "hookimpl", "hookspec", "get_plugins", "reset_plugins",
]
