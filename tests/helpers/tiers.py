"""The three test tiers and how a collected test is placed in one (tests/conftest.py applies it)."""

TIERS = ("unit", "stage", "system")
SYSTEM_FIXTURES = {"prefect_server"}  # fixtures that start servers or processes
STAGE_FIXTURES = {"tiny_model"}  # fixtures that build or load the tiny model
# a test module that imports from these runs stages, trains or loads models: its tests are `stage` at least
STAGE_MODULES = ("alignflow.flows.stages", "alignflow.core.train.engine", "alignflow.core.train.models", "alignflow.core.train.adapters")


def tiers_of(item) -> set[str]:
    """The tier markers on a collected test (its own, its class's and its module's)."""
    return {m.name for m in item.iter_markers() if m.name in TIERS}


def runs_stages(module) -> bool:
    """Whether a test module imported a stage runner, the engine or the model loaders."""
    return any(isinstance(getattr(value, "__module__", None), str) and value.__module__.startswith(STAGE_MODULES)
               for value in vars(module).values() if callable(value))


def default_tier(item) -> str:
    """The tier of a test without an explicit one: by the fixtures it uses, then by what its module imports."""
    names = set(getattr(item, "fixturenames", ()))
    if names & SYSTEM_FIXTURES:
        return "system"
    module = getattr(item, "module", None)
    return "stage" if names & STAGE_FIXTURES or (module is not None and runs_stages(module)) else "unit"
