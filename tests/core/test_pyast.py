"""pyast.parse: a parse that loses CPython 3.11.7's AST-depth race to another thread is parsed again; other
errors are raised as they are."""

import ast

import pytest

from alignflow.core import pyast

RACE = SystemError("AST constructor recursion depth mismatch (before=189, after=76)")


def flaky(fails: int, error: Exception):
    calls = []
    real = ast.parse

    def parse(source, mode="exec"):
        calls.append(source)
        if len(calls) <= fails:
            raise error
        return real(source, mode=mode)

    return parse, calls


def test_a_lost_depth_race_is_parsed_again(monkeypatch):
    parse, calls = flaky(2, RACE)
    monkeypatch.setattr(pyast.ast, "parse", parse)
    tree = pyast.parse("1 + 2", mode="eval")
    assert isinstance(tree.body, ast.BinOp) and len(calls) == 3


def test_it_gives_up_after_its_attempts_and_other_errors_pass_through(monkeypatch):
    parse, calls = flaky(pyast.ATTEMPTS, RACE)
    monkeypatch.setattr(pyast.ast, "parse", parse)
    with pytest.raises(SystemError, match="recursion depth mismatch"):
        pyast.parse("x = 1")
    assert len(calls) == pyast.ATTEMPTS
    parse, calls = flaky(1, SystemError("something else"))
    monkeypatch.setattr(pyast.ast, "parse", parse)
    with pytest.raises(SystemError, match="something else"):
        pyast.parse("x = 1")
    assert len(calls) == 1
    with pytest.raises(SyntaxError):
        pyast.parse("x = ")
