"""An own one-process group's launcher variables, inherited by a process started from it, are told apart
from a launcher's: dropped where a stage forms its own group, kept (the mark alone dropped) in a launcher's worker."""

import os

from alignflow.core.train import own_group

OWN = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29555", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}


def test_inherited_own_group_variables_are_dropped(monkeypatch):
    monkeypatch.setattr(os, "environ", {**OWN, own_group.MARK: "1", "PATH": "/bin"})
    assert own_group.marked()
    own_group.drop()
    assert os.environ == {"PATH": "/bin"}


def test_a_launchers_variables_are_never_dropped(monkeypatch):
    monkeypatch.setattr(os, "environ", {**OWN, "RANK": "3", "WORLD_SIZE": "4"})
    own_group.drop()  # no mark: a launcher's
    assert os.environ["RANK"] == "3" and not own_group.marked()
    monkeypatch.setattr(os, "environ", {**OWN, "RANK": "3", own_group.MARK: "1"})
    own_group.unmark()  # a worker that inherited the mark from its parent
    assert os.environ["RANK"] == "3" and not own_group.marked()
