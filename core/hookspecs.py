"""The hooks a plugin may implement. Each receives a `register` callback."""

import pluggy

hookspec = pluggy.HookspecMarker("alignflow")
hookimpl = pluggy.HookimplMarker("alignflow")


@hookspec
def register_algorithms(register):
    """register(name, AlgorithmClass)"""


@hookspec
def register_rewards(register):
    """register(name, reward): a function or a class with a `Config`"""


@hookspec
def register_samplers(register):
    """register(name, SamplerClass)"""


@hookspec
def register_selectors(register):
    """register(name, SelectorClass)"""


@hookspec
def register_environments(register):
    """register(name, EnvironmentClass): a subclass of alignflow.core.environments.Environment"""
