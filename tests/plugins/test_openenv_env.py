"""The openenv environment against real OpenEnv servers (tests/helpers/openenv_server.py, built with
openenv-core's own server classes) on 127.0.0.1: episodes through `Episodes.generate` on a scripted sampler."""

import os
import random
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from alignflow.core import AlignflowError, Sampler, seeds
from alignflow.core.environments.episodes import Episodes
from alignflow.core.sampling import Generation
from alignflow.core.spec.settings import GenerationSettings
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.flows.launch.shutdown import descendants
from alignflow.plugins.openenv_env import OpenEnv, tool_result, ws_url

TOK = build_char_tokenizer(1024)
GEN = GenerationSettings(max_new_tokens=40, temperature=1.0)
TESTS = Path(__file__).resolve().parents[1]
SERVER = [sys.executable, "-m", "helpers.openenv_server", "--port", "{port}"]
GAME = {"action_field": "message", "observation_field": "text", "reset_columns": ["high"], "prompt": True}


class Scripted(Sampler):
    """Writes `script(context_text, call)` for every context, then the stop token."""

    def __init__(self, script):
        super().__init__()
        self.script, self.calls = script, 0

    def generate(self, prompt_ids, n, gen, seed):
        rows = [TOK(self.script(TOK.decode(ids), self.calls), add_special_tokens=False).input_ids + [TOK.eos_token_id]
                for ids in prompt_ids for _ in range(n)]
        self.calls += 1
        return Generation([i for i in range(len(prompt_ids)) for _ in range(n)], rows,
                          [TOK.decode(r, skip_special_tokens=True) for r in rows], [False] * len(rows),
                          [[-1.0] * len(r) for r in rows])


def bisect(context, call):
    """Guesses by halving the range the game's hints leave (from 1 to the `high` the first message names)."""
    low, high = 1, int(re.search(r"from 1 to (\d+)", context)[1])
    for guess, hint in re.findall(r"(\d+)\D*?(higher|lower)", context):
        low, high = (int(guess) + 1, high) if hint == "higher" else (low, int(guess) - 1)
    return str((low + high) // 2)


def secret(seed, row, high):
    return random.Random(seeds.episode(seed, row)).randint(1, high)  # as the test server draws it


def episodes(max_turns=6, max_tokens=None, **config) -> Episodes:
    return Episodes(OpenEnv, OpenEnv.Config(**config), max_turns=max_turns, max_tokens=max_tokens, name="openenv")


@pytest.fixture(scope="module")
def server_url():
    """The test server, started once for this module's url-mode tests."""
    pytest.importorskip("openenv")
    from alignflow.core.servers import ChildServer

    with ChildServer(SERVER, "/health", 120.0, cwd=str(TESTS), what="test server") as server:
        yield server.url


@pytest.mark.system
def test_episodes_play_the_servers_game_for_its_rewards(server_url):
    rows = [{"prompt": "Play.", "high": 10}, {"prompt": "Play.", "high": 20}]
    g = episodes(url=server_url, **GAME).generate(Scripted(bisect), TOK, rows, 2, GEN, seed=3)
    # each row's two episodes start from one seed, sent with the row's `high`: the same secret, the same game
    for k, (row, high) in enumerate([(0, 10), (0, 10), (1, 20), (1, 20)]):
        messages = g.episodes["messages"][k]
        assert messages[0] == {"role": "user", "content": f"Play.\n\nGuess my number from 1 to {high}."}
        guesses = [int(m["content"]) for m in messages if m["role"] == "assistant"]
        assert guesses[-1] == secret(3, row, high)
        hints = [m["content"] for m in messages[2::2]]  # what the server said between the guesses
        assert hints == ["higher" if guess < guesses[-1] else "lower" for guess in guesses[:-1]]
        turns = len(guesses)
        assert g.episodes["turns"][k] == turns and g.episodes["ended"][k] == "done"
        assert g.episodes["reward"][k] == pytest.approx(1.0 - 0.1 * (turns - 1))  # the server's rewards, summed
    assert g.episodes["messages"][0] == g.episodes["messages"][1] != g.episodes["messages"][2]
    assert max(g.episodes["turns"]) > 1  # hints were read and acted on, not a lucky first guess


@pytest.mark.system
def test_tool_calls_become_call_tool_actions_with_the_servers_schemas(server_url):
    def script(context, call):
        if call == 0:  # a right call, an unknown tool, arguments the server refuses
            return '<call>add {"a": 5, "b": 7}</call><call>mul {"a": 1}</call><call>add {"a": "x"}</call>'
        answer = 12 if "right" in context else 13
        return f'<call>submit {{"answer": {answer}}}</call>'

    rows = [{"prompt": "right"}, {"prompt": "wrong"}]
    g = episodes(url=server_url + "/tools", max_tokens=2000, tools=True, action_field=None,
                 observation_field="result", prompt=True).generate(Scripted(script), TOK, rows, 1, GEN, seed=0)
    assert g.tools == [
        {"type": "function", "function": {"name": "add", "description": "Add two whole numbers.", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["a", "b"],
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}},
        {"type": "function", "function": {"name": "submit", "description": "Submit the final answer.", "parameters": {
            "type": "object", "additionalProperties": False, "required": ["answer"],
            "properties": {"answer": {"type": "integer"}}}}}]
    first = g.episodes["messages"][0]
    assert first[0]["content"] == "right\n\nWhat is 5 + 7? Use the tools, then submit."
    results = [m for m in first if m["role"] == "tool"]
    assert [m["name"] for m in results] == ["add", "mul", "add"] and results[0]["content"] == "12"
    assert results[1]["content"] == "error: unknown tool 'mul' (tools: add, submit)"
    assert results[2]["content"].startswith("error: ") and "valid integer" in results[2]["content"]
    assert g.episodes["tool_calls"] == [4, 4] and g.episodes["tool_errors"] == [2, 2]
    assert g.episodes["reward"] == [1.0, 0.0] and g.episodes["ended"] == ["done", "done"]  # submit ends it
    assert "<result>12</result>" in g.texts[0]  # the tag format's result, as the tiny model reads it


@pytest.mark.system
def test_a_server_too_slow_for_timeout_s_ends_that_episode_as_an_error(server_url):
    def script(context, call):
        return "sleep 6" if "slow" in context else bisect(context, call)

    rows = [{"prompt": "fast", "high": 10}, {"prompt": "slow", "high": 10}]
    start = time.monotonic()
    g = episodes(url=server_url, timeout_s=1.0, **GAME).generate(Scripted(script), TOK, rows, 1, GEN, seed=0)
    assert g.episodes["ended"] == ["done", "error"] and g.episodes["turns"][1] == 1
    assert g.episodes["reward"][0] > 0.5 and g.episodes["reward"][1] == 0.0
    # a second for the slow step and at most one more to close its connection, not the six it sleeps
    assert time.monotonic() - start < 4.5


def dead(pid: int, timeout_s: float = 10.0) -> None:
    """Wait until `pid` has exited (gone, or a zombie its parent has not reaped yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return
        except (OSError, IndexError):
            return
        time.sleep(0.01)
    raise AssertionError(f"pid {pid} still runs {timeout_s:g} s after SIGKILL")


@pytest.mark.system
def test_command_mode_holds_one_server_for_a_stage_restarts_a_dead_one_and_leaves_none_even_on_ctrl_c(tmp_path, request):
    pytest.importorskip("openenv")
    pidfile = tmp_path / "pid"
    config = dict(command=SERVER, cwd=str(TESTS), env={"OPENENV_TEST_PIDFILE": str(pidfile)}, **GAME)
    before = set(descendants(os.getpid()))
    rows = [{"prompt": f"say {secret(0, 0, 10)}", "high": 10}, {"prompt": "Play.", "high": 10}]
    killed = []

    def script(context, call):
        if call == 1 and not killed:  # after the first step: the server dies under the second episode
            killed.append(int(pidfile.read_text()))
            os.kill(killed[0], 9)
            dead(killed[0])  # dead before the next round looks (SIGKILL lands late on a loaded machine)
        said = re.search(r"say (\d+)", context)
        return said[1] if said else ("1" if secret(0, 1, 10) != 1 else "2")

    def interrupted(context, call):  # Ctrl-C while the server works on the step
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        return "sleep 2"

    # Ctrl-C as a terminal sends it; a pytest-xdist worker ignores SIGINT, so the test restores Python's handler
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    with pytest.raises(KeyboardInterrupt):
        with episodes(**config).hold() as held:  # as a stage holds it: one server for every round
            g = held.generate(Scripted(script), TOK, rows, 1, GEN, seed=0)
            assert g.episodes["ended"] == ["done", "error"]  # the first had won at its first guess
            assert g.episodes["reward"] == [1.0, pytest.approx(-0.1)] and g.episodes["turns"] == [1, 2]
            # the stage goes on: the next round finds the server dead and starts another, which later rounds share
            for _ in range(2):
                g = held.generate(Scripted(bisect), TOK, rows[1:], 1, GEN, seed=0)
                assert g.episodes["ended"] == ["done"] and g.episodes["reward"][0] > 0.5
                pids = set(descendants(os.getpid())) - before
                assert int(pidfile.read_text()) in pids and killed[0] not in pids
            assert len(pids) == 1  # one server, nothing it left
            held.generate(Scripted(interrupted), TOK, rows[1:], 1, GEN, seed=0)
    assert set(descendants(os.getpid())) == before  # stopped on the interrupt too


@pytest.mark.system
def test_a_server_that_is_not_there_is_a_clear_error():
    with pytest.raises(AlignflowError, match=r"no OpenEnv server answers at http://127.0.0.1:9/health"):
        episodes(url="http://127.0.0.1:9").generate(Scripted(bisect), TOK, [{"prompt": "x"}], 1, GEN, seed=0)


def test_config_needs_exactly_one_server():
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnv.Config()
    with pytest.raises(ValueError, match="exactly one of url"):
        OpenEnv.Config(url="http://127.0.0.1:1", command=["serve"])
    with pytest.raises(ValueError, match="not an http"):
        OpenEnv.Config(url="127.0.0.1:8000")


def test_urls_and_tool_results():
    assert ws_url("http://127.0.0.1:8000/") == "ws://127.0.0.1:8000/ws"
    assert ws_url("https://host/env") == "wss://host/env/ws"
    mcp = {"content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "is_error": False}
    assert tool_result({"result": mcp}) == ("a\nb", False)
    assert tool_result({"result": {**mcp, "is_error": True}}) == ("a\nb", True)
    assert tool_result({"result": None, "error": {"message": "boom"}}) == ("error: boom", True)
    assert tool_result({"result": {"x": 1}}) == ('{"x": 1}', False)
