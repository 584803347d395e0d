"""The built-in `python` tool runs the model's code in the sandbox; a failure is an error observation."""

import socket

import pytest

from alignflow.core.environments import ToolCall, call_tools, python

pytestmark = pytest.mark.system  # each call starts a sandboxed interpreter


def test_python_prints_and_failures_are_counted_observations():
    with socket.socket() as server:  # a listener the host reaches: the sandbox must not
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        calls = [ToolCall("python", {"code": "print(sum(range(10)))"}),
                 ToolCall("python", {"code": "raise SystemExit('bad input')"}),
                 ToolCall("python", {"code": f"import socket; socket.create_connection(('127.0.0.1', {port}), "
                                             "timeout=2); print('connected')"}),
                 ToolCall("python", {"code": "while True: pass"})]
        messages, errors = call_tools([python], calls)
    assert messages[0]["content"] == "45"
    assert errors == 3
    assert "bad input" in messages[1]["content"] and messages[1]["content"].startswith("error: python raised")
    assert messages[2]["content"].startswith("error: python raised") and "connected" not in messages[2]["content"]
    assert "TimeoutError" in messages[3]["content"] or "exit -" in messages[3]["content"]  # CPU or wall limit
