"""Tools from MCP servers: a stdio command or a streamable-HTTP server on loopback, connected once per batch of
episodes through the `mcp` SDK (the `mcp` extra) and offered to every episode beside the environment's own tools.

The sessions live on an event loop of their own, in a thread: episodes step in threads and on per-turn event
loops (`concurrently`), so a tool call is sent to that loop and waited for where the episode runs. Each server's
tools keep the name, description and input schema it declares; a call's answer is its text, and a result the
server marks as an error, a refused call or one past `timeout_s` is a `ToolError`: an error observation the model
reads, counted like a Python tool's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.util
import ipaddress
import json
import logging
import shlex
import shutil
import sys
import tempfile
import threading
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, model_validator

from alignflow.core.environments.contract import EpisodeError
from alignflow.core.environments.tools import ToolError

log = logging.getLogger(__name__)
STOP_S = 15.0  # the SDK stops a stdio server within 6 s (stdin closed, 2 s; SIGTERM, 2 s; SIGKILL): room beyond it


class McpServer(BaseModel):
    """One MCP server whose tools the episodes get: a stdio `command` started for each batch, or a running `url`."""

    model_config = ConfigDict(extra="forbid")
    command: list[str] | None = None  # a stdio server: its program and arguments, e.g. [mcp-server-time]
    env: dict[str, str] = Field(default_factory=dict)  # the command's environment variables, beside HOME, PATH, USER, SHELL, TERM, LOGNAME
    cwd: str | None = None  # the command's working folder (default: where alignflow runs)
    url: str | None = None  # in place of a command: a streamable-HTTP server already running on loopback, e.g. http://127.0.0.1:8000/mcp
    timeout_s: float = Field(30.0, gt=0)  # one tool call's limit: one not answered by then is an error observation
    start_timeout_s: float = Field(60.0, gt=0)  # to start, connect and list the tools, else the stage stops with an error
    tools: list[str] | None = None  # the server's tools to offer, by name (None: every tool it lists)

    @model_validator(mode="after")
    def _one_transport(self):
        if (self.command is None) == (self.url is None):
            raise ValueError("give a server exactly one of `command` (a stdio server) and `url` (streamable HTTP)")
        if self.command is not None and not self.command:
            raise ValueError("`command` is empty: expected the program and its arguments, e.g. [mcp-server-time]")
        if self.url is not None:
            if self.env or self.cwd is not None:
                raise ValueError("`env` and `cwd` are for a `command`: a `url` server runs on its own")
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not _loopback(parts.hostname):
                raise ValueError(f"url {self.url!r}: expected http://127.0.0.1:PORT/PATH (or localhost, [::1]): "
                                 "an MCP server over HTTP must listen on this machine's loopback")
        return self

    @property
    def label(self) -> str:
        """The server as errors name it: its command line, or its URL."""
        return shlex.join(self.command) if self.command is not None else self.url


def _loopback(host: str | None) -> bool:
    try:
        return host == "localhost" or (host is not None and ipaddress.ip_address(host).is_loopback)
    except ValueError:
        return False


class McpTool:
    """A tool an MCP server serves: its name, its schema as the server declares it, and a call that answers
    with the result's text (a `ToolError` when the server reports one, refuses the call, or runs past the limit)."""

    def __init__(self, sessions: "McpSessions", server: McpServer, client: Any, tool: Any):
        self.__name__ = tool.name
        self.server, self._sessions, self._client = server, sessions, client
        self.schema = {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                                        "parameters": tool.input_schema}}

    def __call__(self, **arguments: Any) -> str:
        return self._sessions.call(self, arguments)

    def __repr__(self) -> str:
        return f"<MCP tool {self.__name__!r} of {self.server.label}>"


def result_text(result: Any) -> str:
    """A CallToolResult as the model reads it: its text blocks joined; other blocks named; with no content, its
    structured content as JSON."""
    parts = [block.text if block.type == "text" else f"[{block.type} content]" for block in result.content]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


class McpSessions:
    """Connected MCP servers and their tools, on an event loop in a thread of its own until `close`."""

    def __init__(self, servers: list[McpServer]):
        self.servers = servers
        self.tools: list[McpTool] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: Any = None  # an anyio.Event, set on the loop
        self._started = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, name="mcp-sessions", daemon=True)

    def start(self) -> "McpSessions":
        """Start every server and list its tools; an EpisodeError naming the server when one cannot be."""
        self._thread.start()
        error = self._started.result()  # bounded: each server's start runs under its start_timeout_s
        if error is not None:
            self._thread.join(STOP_S)
            raise error
        return self

    def close(self) -> None:
        """Stop every server (a stdio server's process ends) and the loop's thread."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(STOP_S)  # the servers stop at once, each in its own task
        if self._thread.is_alive():
            log.warning("MCP servers %s did not stop within %.0f s", [s.label for s in self.servers], STOP_S)

    def call(self, tool: McpTool, arguments: dict) -> str:
        """`tool`'s answer to `arguments`, waited for in the calling thread."""
        limit = tool.server.timeout_s
        future = asyncio.run_coroutine_threadsafe(self._call(tool, arguments), self._loop)
        try:
            result = future.result(limit + STOP_S)  # the loop enforces `limit`; this only guards a stuck loop
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise ToolError(f"no answer within {limit:g} s") from None
        if result.is_error:
            raise ToolError(result_text(result) or "the server reported an error")
        return result_text(result)

    async def _call(self, tool: McpTool, arguments: dict):
        import anyio
        from mcp import MCPError

        try:
            with anyio.fail_after(tool.server.timeout_s):
                return await tool._client.call_tool(tool.__name__, arguments)
        except TimeoutError:
            raise ToolError(f"no answer within {tool.server.timeout_s:g} s") from None
        except MCPError as exc:  # the server refused the call (an unknown name, invalid parameters)
            raise ToolError(str(exc)) from None

    def _main(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to `start`, or logged once it has returned
            if not self._started.done():
                self._started.set_result(EpisodeError(f"MCP servers could not be served: {_what(exc)}"))
            else:
                log.warning("MCP sessions ended with an error: %s", _what(exc))

    async def _serve(self) -> None:
        import anyio

        self._loop, self._stop = asyncio.get_running_loop(), anyio.Event()
        with ExitStack() as files:
            async with anyio.create_task_group() as group:
                for server in self.servers:
                    errlog = files.enter_context(tempfile.TemporaryFile("w+", errors="replace"))  # its stderr
                    try:
                        with anyio.fail_after(server.start_timeout_s):
                            self.tools += await group.start(self._hold, server, errlog)
                    except Exception as exc:  # noqa: BLE001 - named here; the servers started so far are stopped
                        self._started.set_result(_start_error(server, exc, errlog))
                        self._stop.set()
                        return
                self._started.set_result(None)

    async def _hold(self, server: McpServer, errlog, task_status) -> None:
        """Connect to `server`, report its tools, and keep the session until `close`."""
        from mcp import Client

        started = False
        try:
            async with Client(_transport(server, errlog)) as client:
                tools = await _listed(client, server)
                task_status.started([McpTool(self, server, client, t) for t in tools])
                started = True
                await self._stop.wait()
        except Exception as exc:
            if not started:
                raise
            # a server that fails mid-batch: its calls answer with errors; the other servers go on
            log.warning("MCP server %s failed: %s", server.label, _what(exc))


def _transport(server: McpServer, errlog):
    """The SDK transport for `server`: its command spawned with stderr to `errlog`, or its URL."""
    from mcp.client.stdio import StdioServerParameters, stdio_client
    from mcp.client.streamable_http import streamable_http_client

    if server.url is not None:
        return streamable_http_client(server.url)
    params = StdioServerParameters(command=_program(server.command[0]), args=server.command[1:],
                                   env=server.env or None, cwd=server.cwd)
    return stdio_client(params, errlog=errlog)


def _program(name: str) -> str:
    """`name` on PATH, else beside this Python (a console script installed with alignflow), else as given."""
    if shutil.which(name) or "/" in name:
        return name
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.is_file() else name


async def _listed(client, server: McpServer) -> list:
    """The server's tools (every page), only those `server.tools` keeps; an error naming any it lacks."""
    tools, cursor = [], None
    for _ in range(100):  # a paginator that never ends cannot hang the start
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if cursor is None:
            break
    if server.tools is None:
        return tools
    names = {t.name for t in tools}
    missing = [n for n in server.tools if n not in names]
    if missing:
        raise LookupError(f"it has no tool {', '.join(map(repr, missing))} (it lists {', '.join(sorted(names))})")
    return [t for t in tools if t.name in server.tools]


def _start_error(server: McpServer, exc: BaseException, errlog) -> EpisodeError:
    """What a server that could not be started or listed did, and what it said on stderr."""
    what = f"no answer within start_timeout_s={server.start_timeout_s:g} s" if isinstance(exc, TimeoutError) \
        else _what(exc)
    said = ""
    if server.command is not None:
        errlog.flush()
        errlog.seek(0)
        tail = errlog.read()[-2000:].strip()
        said = f"; its stderr ended:\n{tail}" if tail else "; it wrote nothing to stderr"
    return EpisodeError(f"MCP server {server.label} could not be started and listed: {what}{said}")


def _what(exc: BaseException) -> str:
    """An exception as one line, the first leaf of an exception group (anyio's task groups raise them)."""
    while getattr(exc, "exceptions", None):
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"


@contextmanager
def mcp_tools(servers: list[McpServer]) -> Iterator[list[McpTool]]:
    """The tools of `servers`, connected for the block and stopped when it ends, fails or is interrupted."""
    if not servers:
        yield []
        return
    if importlib.util.find_spec("mcp") is None:
        raise EpisodeError(f"MCP servers ({', '.join(s.label for s in servers)}) need the MCP SDK: "
                           "pip install 'alignflow[mcp]'")
    sessions = McpSessions(servers).start()
    try:
        yield list(sessions.tools)
    finally:
        sessions.close()
