"""The three test tiers and how a collected test is placed in one (tests/conftest.py applies it)."""

TIERS = ("unit", "stage", "system")
SYSTEM_FIXTURES = {"prefect_server"}  # fixtures that start servers or processes
STAGE_FIXTURES = {"tiny_model"}  # fixtures that build or load the tiny model


def tiers_of(item) -> set[str]:
    """The tier markers on a collected test (its own, its class's and its module's)."""
    return {m.name for m in item.iter_markers() if m.name in TIERS}


def default_tier(item) -> str:
    """The tier of a test without an explicit one: by the fixtures it uses."""
    names = set(getattr(item, "fixturenames", ()))
    return "system" if names & SYSTEM_FIXTURES else "stage" if names & STAGE_FIXTURES else "unit"
