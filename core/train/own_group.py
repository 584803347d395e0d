"""torch's launcher variables that this project set itself, told apart from a launcher's.

Without a launcher the engine forms a one-process group through torch's env:// rendezvous, which reads
RANK, WORLD_SIZE, MASTER_ADDR/PORT and LOCAL_RANK from the environment; it sets them, and `MARK` beside
them naming the values it set. Every process started from it inherits all of them (a stage's child, a
subprocess running `alignflow run`): where the mark still names the current values they are an own
group's, which such a process drops to form its own; a launcher started from it gives its workers other
values (address, world size or rank), whose variables are then the launcher's.
"""

import os

MARK = "ALIGNFLOW_OWN_PROCESS_GROUP"
VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def _values() -> str:
    """What the mark vouches for: a launcher's workers differ in one of them."""
    return ",".join(f"{var}={os.environ.get(var)}" for var in VARIABLES)


def mark() -> None:
    """Say that the launcher variables now set are this process's own group's."""
    os.environ[MARK] = _values()


def marked() -> bool:
    """Whether the launcher variables here are a one-process group's that this process or a parent formed."""
    return MARK in os.environ and os.environ[MARK] == _values()


def drop() -> None:
    """Forget an own group's variables (inherited from a parent), so the next group formed here is this
    process's; a launcher's variables stay, and only a stale mark goes."""
    if marked():
        for var in VARIABLES:
            os.environ.pop(var, None)
    os.environ.pop(MARK, None)
