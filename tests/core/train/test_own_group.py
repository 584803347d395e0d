"""An own one-process group's launcher variables, inherited by a process started from it, are told apart
from a launcher's: dropped where a stage forms its own group, kept (the stale mark alone dropped) in a
launcher's worker, whose launcher set other values."""

import os

from alignflow.core.train import own_group

OWN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def test_inherited_own_group_variables_are_dropped(monkeypatch):
    monkeypatch.setattr(os, "environ", {**OWN, "PATH": "/bin"})
    own_group.mark()
    assert own_group.marked()
    own_group.drop()
    assert os.environ == {"PATH": "/bin"} and not own_group.marked()


def test_a_launchers_variables_are_never_dropped(monkeypatch):
    monkeypatch.setattr(os, "environ", {**OWN, "RANK": "3", "WORLD_SIZE": "4"})
    own_group.drop()  # no mark: a launcher's
    assert os.environ["RANK"] == "3" and not own_group.marked()
    # a worker of a launcher started from a process with its own group: the mark names the parent's address
    monkeypatch.setattr(os, "environ", dict(OWN))
    own_group.mark()
    os.environ.update(RANK="3", WORLD_SIZE="4")  # a launcher that kept the address
    assert not own_group.marked()
    own_group.drop()
    assert os.environ["RANK"] == "3" and os.environ["WORLD_SIZE"] == "4" and own_group.MARK not in os.environ
