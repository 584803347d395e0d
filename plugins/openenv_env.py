"""openenv environment: episodes played against an OpenEnv server (https://github.com/meta-pytorch/OpenEnv),
one WebSocket session per episode.

The protocol (openenv-core 0.3, `HTTPEnvServer`): the client opens `ws://HOST/ws` and sends
`{"type": "reset", "data": {"seed": ..., ...}}` or `{"type": "step", "data": ACTION}`; each is answered
`{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}` or
`{"type": "error", "data": {"message": ..., "code": ...}}`; `{"type": "close"}` ends the session. Servers
built on `MCPEnvironment` also answer `{"type": "mcp", "data": JSON-RPC}` (`tools/list`, which is no step) and
take the step action `{"type": "call_tool", "tool_name": ..., "arguments": {...}}`.

Server lifetime: `batch` (held by `Episodes` for one `generate` call, or for a whole stage) starts the
`command` server, or checks that the `url` one answers, before the first episode; every episode of the
batch connects to it, and a `command` server is stopped after the last has closed, also on failure.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from contextlib import contextmanager, suppress
from typing import Any, Iterator
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from alignflow.core import AlignflowError, PluginConfig, hookimpl
from alignflow.core.environments import Environment, Step, ToolCall, Turn

log = logging.getLogger(__name__)
MAX_MESSAGE = 100 << 20  # bytes in one answer: observations may carry screenshots (openenv's client allows this)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def _connect():
    try:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed
    except ImportError as exc:
        raise AlignflowError("environment 'openenv' needs the websockets library (15 or newer): "
                             "pip install 'alignflow[openenv]'") from exc
    return connect, ConnectionClosed


class ServerTool:
    """A tool the server lists: shown to the model with the server's own schema, called through the server."""

    def __init__(self, spec: dict):
        self.__name__ = spec["name"]
        params = spec.get("input_schema") or spec.get("inputSchema") or {"type": "object", "properties": {}}
        self.schema = {"type": "function", "function": {"name": spec["name"],
                                                        "description": spec.get("description") or "",
                                                        "parameters": params}}


class OpenEnv(Environment):
    """An OpenEnv server's environment: the turn's text (or its tool calls) as actions, its observations back."""

    class Config(PluginConfig):
        url: str | None = None  # a running server, e.g. http://127.0.0.1:8000 (ws:// too); or `command`
        command: list[str] | None = None  # a server the stage starts; `{port}` in it (and $PORT): a free loopback port
        env: dict[str, str] = Field(default_factory=dict)  # environment variables for `command`, over the stage's
        cwd: str | None = None  # working directory of `command`
        start_timeout_s: float = Field(120.0, gt=0)  # how long `command` may take to answer GET /health
        timeout_s: float = Field(60.0, gt=0)  # per message (connect, reset, step); no answer ends the episode: error
        action_field: str | None = "message"  # the action field a turn's text goes in; None: a text turn ends it
        action: dict[str, Any] = Field(default_factory=dict)  # fixed fields sent with every text action
        tools: bool = False  # list the server's MCP tools at reset; the model's tool calls become call_tool actions
        observation_field: str | None = None  # the observation field the model reads (text, messages); None: all, JSON
        reset: dict[str, Any] = Field(default_factory=dict)  # fixed reset arguments beside `seed`
        reset_columns: list[str] = Field(default_factory=list)  # dataset row columns sent as reset arguments
        prompt: bool = False  # the row's prompt first, then the reset observation, in one user message
        system_prompt: str | None = None  # a system message before the first

        @model_validator(mode="after")
        def one_server(self):
            if (self.url is None) == (self.command is None):
                raise ValueError("set exactly one of url (a running server) and command (a server to start)")
            if self.command is not None and not self.command:
                raise ValueError("command: an empty list; give the server's command line")
            if self.url is not None and urlsplit(self.url).scheme not in ("http", "https", "ws", "wss"):
                raise ValueError(f"url: {self.url!r} is not an http(s):// or ws(s):// address")
            return self

    def __init__(self, config: PluginConfig | None = None, url: str | None = None):
        super().__init__(config)
        self.url = (url or self.config.url or "").rstrip("/")  # `batch` gives the started server's
        self.ws = None
        self.server_tools: list[ServerTool] = []

    @classmethod
    @contextmanager
    def batch(cls, config: PluginConfig) -> Iterator:
        """The server every episode connects to: checked (`url`), or started (`command`) and started again
        for the next batch if it has died since (held for a stage, a crash costs only the episodes it hit)."""
        if config.command is None:
            check_health(config.url, config.timeout_s)
            yield lambda: cls(config)
            return
        from alignflow.core.servers import ChildServer

        with ChildServer(config.command, "/health", config.start_timeout_s, config.env, config.cwd,
                         "environment 'openenv'") as server:
            def make() -> OpenEnv:
                if not server.alive():
                    log.warning("environment 'openenv': the server (%s) has stopped; starting it again",
                                " ".join(config.command))
                    server.start()
                return cls(config, server.url)

            yield make

    def tools(self) -> list:
        return list(self.server_tools)

    async def reset(self, row: dict, seed: int) -> str | list[dict]:
        connect, _ = _connect()
        data = {**self.config.reset, **{c: _column(row, c) for c in self.config.reset_columns}, "seed": seed}
        host = urlsplit(self.url).hostname
        try:
            self.ws = await connect(ws_url(self.url), open_timeout=self.config.timeout_s, max_size=MAX_MESSAGE,
                                    close_timeout=min(self.config.timeout_s, 5.0),
                                    **({"proxy": None} if host in LOOPBACK else {}))
        except Exception as exc:  # refused, timed out, or a handshake the server answered with an HTTP error
            raise AlignflowError(f"OpenEnv server {self.url}: cannot connect to {ws_url(self.url)} "
                                 f"({type(exc).__name__}: {exc})") from exc
        answer = await self._ask({"type": "reset", "data": data}, "reset")
        if answer.get("done"):
            raise AlignflowError(f"OpenEnv server {self.url}: the episode was over at reset (done: true)")
        if self.config.tools:
            self.server_tools = await self._list_tools()
        first = self._message(answer.get("observation") or {})
        if self.config.prompt:
            text = first if isinstance(first, str) else json.dumps(first, ensure_ascii=False)
            first = f"{row['prompt']}\n\n{text}"
        if self.config.system_prompt is None:
            return first
        messages = [{"role": "user", "content": first}] if isinstance(first, str) else first
        return [{"role": "system", "content": self.config.system_prompt}, *messages]

    async def step(self, turn: Turn) -> Step:
        if self.config.tools and turn.tool_calls:
            return await self._call_tools(turn.tool_calls)
        if self.config.action_field is None:  # nothing to send: the model answered without a tool call
            return Step(done=True)
        action = {**self.config.action, self.config.action_field: turn.text}
        answer = await self._ask({"type": "step", "data": action}, f"step (turn {turn.index})")
        done = bool(answer.get("done"))
        return Step(observation=None if done else self._message(answer.get("observation") or {}),
                    reward=_reward(answer), done=done)

    async def close(self) -> None:
        ws, self.ws = self.ws, None
        if ws is None:
            return
        # the server ends the session cleanly on `close`; one that died or hangs is past telling
        with suppress(Exception):
            await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), self.config.timeout_s)
        await ws.close()

    async def _ask(self, message: dict, what: str) -> dict:
        """Send one message and return its answer's data; no answer within timeout_s, a closed connection or
        the server's error raise an AlignflowError naming the server."""
        _, ConnectionClosed = _connect()
        if self.ws is None:
            raise AlignflowError("openenv episode is not running: reset it first")
        try:
            await asyncio.wait_for(self.ws.send(json.dumps(message)), self.config.timeout_s)
            raw = await asyncio.wait_for(self.ws.recv(), self.config.timeout_s)
        except asyncio.TimeoutError:
            raise AlignflowError(f"OpenEnv server {self.url}: no answer to {what} within "
                                 f"{self.config.timeout_s:g} s (timeout_s)") from None
        except ConnectionClosed as exc:
            raise AlignflowError(f"OpenEnv server {self.url}: the connection closed during {what} ({exc}); "
                                 "did the server stop?") from None
        answer = json.loads(raw)
        if answer.get("type") == "error":
            raise AlignflowError(f"OpenEnv server {self.url} refused {what}: {_error_text(answer.get('data') or {})}")
        return answer.get("data") or {}

    async def _list_tools(self) -> list[ServerTool]:
        answer = await self._ask({"type": "mcp", "data": {"jsonrpc": "2.0", "method": "tools/list", "params": {},
                                                          "id": 1}}, "tools/list")
        if "error" in answer:
            raise AlignflowError(f"OpenEnv server {self.url}: tools/list failed ({answer['error']}); "
                                 "does it serve an MCPEnvironment? (config tools: true)")
        return [ServerTool(t) for t in (answer.get("result") or {}).get("tools", [])]

    async def _call_tools(self, calls: list[ToolCall]) -> Step:
        """Each call as one call_tool step, in order, until one ends the episode; its result as a tool message."""
        names = sorted(t.__name__ for t in self.server_tools)
        messages, errors, reward, done = [], 0, 0.0, False
        for call in calls:
            if done:
                break
            if call.error or call.name not in names:
                text = f"error: {call.error}" if call.error else \
                    f"error: unknown tool {call.name!r} (tools: {', '.join(names) or 'none'})"
                failed = True
            else:
                answer = await self._ask({"type": "step", "data": {"type": "call_tool", "tool_name": call.name,
                                                                   "arguments": call.arguments}},
                                         f"call_tool {call.name!r}")
                text, failed = tool_result(answer.get("observation") or {})
                reward, done = reward + _reward(answer), bool(answer.get("done"))
            errors += failed
            messages.append({"role": "tool", "name": call.name, "content": text})
        return Step(observation=None if done else messages, reward=reward, done=done, tool_calls=len(calls),
                    tool_errors=errors)

    def _message(self, observation: dict) -> str | list[dict]:
        """What the model reads of an observation: `observation_field`'s text or chat messages, else JSON."""
        field = self.config.observation_field
        if field is None:
            return json.dumps(observation, ensure_ascii=False)
        if field not in observation:
            raise AlignflowError(f"OpenEnv server {self.url}: its observation has no field {field!r} "
                                 f"(observation_field); it has {sorted(observation)}")
        value = observation[field]
        if isinstance(value, str) or _is_messages(value):
            return value
        return json.dumps(value, ensure_ascii=False)


def tool_result(observation: dict) -> tuple[str, bool]:
    """A call_tool observation as the model reads it, and whether the call failed."""
    error = observation.get("error")
    if error:
        return f"error: {error.get('message', error) if isinstance(error, dict) else error}", True
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):  # an MCP CallToolResult
        texts = [c.get("text", "") for c in result["content"] if isinstance(c, dict) and c.get("type") == "text"]
        failed = bool(result.get("is_error") or result.get("isError"))
        return "\n".join(texts) if texts else json.dumps(result.get("data"), ensure_ascii=False), failed
    return (result if isinstance(result, str) else json.dumps(result, ensure_ascii=False)), False


def check_health(url: str, timeout_s: float) -> None:
    """An AlignflowError unless the server at `url` answers GET /health."""
    health = http_url(url) + "/health"
    try:
        with urllib.request.urlopen(health, timeout=timeout_s) as r:
            if r.status == 200:
                return
            raise AlignflowError(f"environment 'openenv': {health} answered {r.status}")
    except (urllib.error.URLError, OSError) as exc:
        raise AlignflowError(f"environment 'openenv': no OpenEnv server answers at {health} ({exc}); start it, "
                             "or give `command` so the stage starts one") from exc


def ws_url(url: str) -> str:
    """The session endpoint of a server at `url`."""
    parts = urlsplit(url)
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    return parts._replace(scheme=scheme, path=parts.path.rstrip("/") + "/ws").geturl()


def http_url(url: str) -> str:
    parts = urlsplit(url)
    return parts._replace(scheme={"ws": "http", "wss": "https"}.get(parts.scheme, parts.scheme)).geturl().rstrip("/")


def _reward(answer: dict) -> float:
    return float(answer.get("reward") or 0.0)  # None: the server gave none this step


def _is_messages(value) -> bool:
    return isinstance(value, list) and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)


def _column(row: dict, name: str):
    if name not in row:
        raise AlignflowError(f"environment 'openenv': reset_columns names {name!r}, which the row does not have "
                             f"(columns: {', '.join(row)})")
    return row[name]


def _error_text(data: dict) -> str:
    """The server's error, with what to change where the code says it."""
    text = f"{data.get('code', 'error')}: {data.get('message', data)}"
    if data.get("errors"):  # VALIDATION_ERROR: which action fields were wrong
        text += " (" + "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}"
                                 for e in data["errors"]) + "; see config action_field and action)"
    if data.get("code") == "CAPACITY_REACHED":
        text += (f"; a batch opens one session per episode and the server allows {data.get('max_sessions')} at "
                 "once: raise its max_concurrent_envs")
    return text


@hookimpl
def register_environments(register):
    register("openenv", OpenEnv)
