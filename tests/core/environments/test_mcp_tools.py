"""Tools from MCP servers: the test server (tests/helpers/mcp_server.py, the SDK's own MCPServer) over stdio and
over streamable HTTP on 127.0.0.1, the published `mcp-server-time` over stdio, and whole episodes that call them."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from alignflow.core.environments import Environment, ToolCall, call_tools, tool_schema
from alignflow.core.environments.episodes import EpisodeError, Episodes
from alignflow.core.environments.mcp import McpServer, mcp_tools
from alignflow.plugins.math_tools import MathTools, calculator

from test_episodes import GEN, TOK, Scripted

pytest.importorskip("mcp")
pytestmark = pytest.mark.system

SERVER = str(Path(__file__).parents[2] / "helpers" / "mcp_server.py")
STDIO = McpServer(command=[sys.executable, SERVER], timeout_s=1.0)
ADD_SCHEMA = {"type": "object", "title": "addArguments", "required": ["a", "b"],
              "properties": {"a": {"title": "A", "type": "integer"}, "b": {"title": "B", "type": "integer"}}}


def run(tools, *calls):
    """Each call's text and how many failed, as the default `step` runs them."""
    messages, errors = call_tools(tools, [ToolCall(name, args) for name, args in calls])
    return [m["content"] for m in messages], errors


def test_a_stdio_server_s_tools_keep_its_schemas_and_every_failure_is_a_counted_observation():
    with mcp_tools([STDIO]) as tools:
        assert [t.__name__ for t in tools] == ["add", "fail", "hang", "pid"]
        assert tool_schema(tools[0]) == {"type": "function", "function": {
            "name": "add", "description": "Add two integers.", "parameters": ADD_SCHEMA}}  # as the server declares
        start = time.perf_counter()
        texts, errors = run(tools + [calculator], ("add", {"a": 20, "b": 22}), ("calculator", {"expression": "6*7"}),
                            ("add", {"a": "twenty", "b": 22}), ("fail", {"message": "boom"}),
                            ("hang", {"seconds": 30}), ("add", {"a": 1, "b": 2}), ("nope", {}))
        took = time.perf_counter() - start
    assert texts[:2] == ["42", "42"] and texts[5] == "3"  # the session still answers after a timed-out call
    assert texts[2].startswith("error: add: ") and "validation error" in texts[2] and "a\n" in texts[2]
    assert texts[3] == "error: fail: Error executing tool fail"  # the SDK hides a crash's message from the caller
    assert texts[4] == "error: hang: no answer within 1 s"
    assert texts[6].startswith("error: unknown tool 'nope' (tools: add, calculator, fail, hang, pid)")
    assert errors == 4
    assert 1.0 <= took < 10.0  # the hang costs its timeout, not its 30 s


def test_a_kept_tool_the_server_lacks_is_named():
    before = children()
    with pytest.raises(EpisodeError, match=r"MCP server .*mcp_server.py could not be started and listed: "
                                           r"LookupError: it has no tool 'mul' \(it lists add, fail, hang, pid\)"):
        with mcp_tools([STDIO.model_copy(update={"tools": ["add", "mul"]})]):
            pass
    assert children() == before


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def http_server():
    """The test server on streamable HTTP at 127.0.0.1: its URL once it accepts connections (20 s at most)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, SERVER, "--port", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        assert proc.poll() is None, "the HTTP test server exited"
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_the_same_server_over_streamable_http_on_loopback(http_server):
    with mcp_tools([McpServer(url=http_server, timeout_s=1.0)]) as tools:
        assert tool_schema(tools[0])["function"]["parameters"] == ADD_SCHEMA
        texts, errors = run(tools, ("add", {"a": 40, "b": 2}), ("hang", {"seconds": 30}))
    assert texts == ["42", "error: hang: no answer within 1 s"] and errors == 1


def time_server(tmp_path, *args) -> McpServer:
    """The published time server as a user starts it: its console script, in a folder of its own."""
    return McpServer(command=["mcp-server-time", *args], cwd=str(tmp_path), timeout_s=10.0)


def test_a_published_server_from_pypi_converts_between_fixed_zones(tmp_path, monkeypatch):
    pytest.importorskip("mcp_server_time")
    monkeypatch.setenv("PATH", "/usr/bin:/bin")  # a virtual environment not activated: its script is found beside Python
    with mcp_tools([time_server(tmp_path, "--local-timezone", "UTC")]) as tools:
        by_name = {t.__name__: t for t in tools}
        assert sorted(by_name) == ["convert_time", "get_current_time"]
        params = tool_schema(by_name["convert_time"])["function"]["parameters"]
        assert params["required"] == ["source_timezone", "time", "target_timezone"]
        # Tokyo and Kolkata keep no daylight saving time: the same answer on any date
        texts, errors = run(tools, ("convert_time", {"source_timezone": "Asia/Tokyo", "time": "12:00",
                                                     "target_timezone": "Asia/Kolkata"}),
                            ("convert_time", {"source_timezone": "Mars/Olympus", "time": "12:00",
                                              "target_timezone": "UTC"}))
    assert '"time_difference": "-3.5h"' in texts[0] and 'T08:30:00+05:30"' in texts[0]
    assert texts[1].startswith("error: convert_time: ") and "Invalid timezone" in texts[1] and errors == 1


def test_a_server_that_does_not_start_is_an_error_naming_it_and_what_it_said(tmp_path):
    pytest.importorskip("mcp_server_time")
    with pytest.raises(EpisodeError) as info:
        with mcp_tools([time_server(tmp_path, "--local-timezone", "Mars/Olympus")]):
            pass
    msg = str(info.value)
    assert msg.startswith("MCP server mcp-server-time --local-timezone Mars/Olympus could not be started")
    assert "invalid --local-timezone 'Mars/Olympus'" in msg  # its stderr
    with pytest.raises(EpisodeError, match="MCP server no-such-mcp-server could not be started and listed: "
                                           "FileNotFoundError"):
        with mcp_tools([McpServer(command=["no-such-mcp-server"])]):
            pass


def children() -> set[int]:
    """This process's live child processes."""
    out = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(os.getpid()) and not fields.get("State", "").startswith("Z"):
            out.add(int(status.parent.name))
    return out


LONG = GEN.model_copy(update={"max_new_tokens": 80})  # room for two calls in a turn


def adds_then_answers(context, turn):
    """Asks the server for the prompt's sum and its own pid, then answers with the sum it was given."""
    if "<result>" not in context:
        a, b = context.rstrip("=").split("+")
        return f'<call>add {{"a": {a}, "b": {b}}}</call><call>pid</call>'
    return f"<answer>{context.split('<result>')[1].split('</result>')[0]}</answer>"


class Bare(Environment):
    """No tools of its own: every tool comes from the stage's MCP servers."""

    def reset(self, row, seed):
        self.answer = row["answer"]
        return row["prompt"]

    def score(self, answer):
        return float(answer == f"<answer>{self.answer}</answer>")


def test_an_episode_s_tool_call_reaches_the_server_and_no_server_outlives_generate():
    before = children()
    rows = [{"prompt": "20+22=", "answer": "42"}, {"prompt": "7+8=", "answer": "15"}]
    g = Episodes(MathTools, MathTools.Config(), mcp=[STDIO.model_copy(update={"tools": ["add", "pid"]})]).generate(
        Scripted(adds_then_answers), TOK, rows, 2, LONG, seed=0)
    assert [t["function"]["name"] for t in g.tools] == ["calculator", "add", "pid"]  # its own, then the server's
    assert g.episodes["reward"] == [1.0] * 4 and g.episodes["tool_calls"] == [2] * 4
    assert g.episodes["tool_errors"] == [0] * 4
    reply = g.episodes["messages"][2][2:4]
    assert reply[0] == {"role": "tool", "name": "add", "content": "15"}  # the server's answer is the observation
    pids = {int(m[3]["content"]) for m in g.episodes["messages"]}
    assert len(pids) == 1  # one server for the whole batch, shared by its four episodes
    assert not Path(f"/proc/{pids.pop()}").exists() and children() == before  # stopped when generate returned


def test_servers_an_environment_names_in_code_serve_its_episodes():
    class Summing(Bare):
        def mcp_servers(self):
            return [STDIO.model_copy(update={"tools": ["add", "pid"]})]

    g = Episodes(Summing, Summing.Config()).generate(Scripted(adds_then_answers), TOK,
                                                     [{"prompt": "20+22=", "answer": "42"}], 1, LONG, seed=0)
    assert [t["function"]["name"] for t in g.tools] == ["add", "pid"]
    assert g.episodes["reward"] == [1.0] and g.episodes["tool_errors"] == [0]
    assert not Path(f"/proc/{int(g.episodes['messages'][0][3]['content'])}").exists()


def test_two_tools_of_one_name_are_an_error_and_the_servers_stop():
    def add(a: int, b: int) -> int:
        """A Python tool whose name a server's tool takes too."""
        return a + b

    class Clashing(MathTools):
        def tools(self):
            return [add]

    before = children()
    clash = Episodes(Clashing, Clashing.Config(), name="clash", mcp=[STDIO.model_copy(update={"tools": ["add"]})])
    with pytest.raises(EpisodeError, match=r"environment 'clash': two tools are named 'add' \(from its tools\(\) "
                                           r"and from MCP server .*mcp_server.py\); keep one with `tools:`"):
        clash.generate(Scripted(lambda c, t: ""), TOK, [{"prompt": "1+1=", "answer": "2"}], 1, GEN, seed=0)
    assert children() == before  # a failed batch stops its servers too


def test_an_interrupted_batch_stops_its_servers():
    class Interrupted(Scripted):
        def generate(self, prompt_ids, n, gen, seed):
            raise KeyboardInterrupt  # Ctrl-C while the model writes its first turn

    before = children()
    with pytest.raises(KeyboardInterrupt):
        Episodes(Bare, Bare.Config(), mcp=[STDIO]).generate(Interrupted(None), TOK, [{"prompt": "1+1=", "answer": "2"}],
                                                            1, GEN, seed=0)
    assert children() == before
