"""A small MCP server for the environment tests, built on the SDK's own `MCPServer`: over stdio by default,
over streamable HTTP on 127.0.0.1 with `--port PORT`."""

import argparse
import os

import anyio

from mcp.server.mcpserver import MCPServer

server = MCPServer("alignflow-test-tools", log_level="CRITICAL")  # no rich traceback per failing call (1 s each)


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool(description="Fail on purpose, with `message`.")
def fail(message: str) -> str:
    raise ValueError(message)


@server.tool()
async def hang(seconds: float) -> str:
    """Sleep `seconds`, then answer: longer than a call's timeout, it is never answered in time."""
    await anyio.sleep(seconds)  # async: the server can end while it sleeps
    return "woke"


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, help="serve streamable HTTP on 127.0.0.1:PORT instead of stdio")
    args = parser.parse_args()
    if args.port is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.port)
