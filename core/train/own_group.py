"""torch's launcher variables that this project set itself, told apart from a launcher's.

Without a launcher the engine forms a one-process group through torch's env:// rendezvous, which reads
RANK, WORLD_SIZE, MASTER_ADDR/PORT and LOCAL_RANK from the environment; it sets them, and `MARK` beside
them. Every process started from it inherits all of them (a stage's child, a subprocess running
`alignflow run`), so the mark is what says "not a launcher's": such a process drops them and forms its own.
"""

import os

MARK = "ALIGNFLOW_OWN_PROCESS_GROUP"
VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")


def marked() -> bool:
    """Whether the launcher variables here are a one-process group's that this process or a parent formed."""
    return MARK in os.environ


def drop() -> None:
    """Forget an own group's variables (inherited from a parent): the next group formed here is this process's."""
    if os.environ.pop(MARK, None) is not None:
        for var in VARIABLES:
            os.environ.pop(var, None)


def unmark() -> None:
    """A launcher's worker: its RANK etc. are the launcher's, whatever mark it inherited from its parent."""
    os.environ.pop(MARK, None)
