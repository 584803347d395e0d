"""Environments: multi-turn, tool-using episodes (the contract, tools, token-in/token-out transcripts, rollouts)."""

from alignflow.core.environments.contract import Environment, EpisodeError, Limits, Message, Step, ToolCall, Turn
from alignflow.core.environments.mcp import McpServer
from alignflow.core.environments.tools import ToolError, call_tools, python, tool_schema

__all__ = ["Environment", "EpisodeError", "Limits", "McpServer", "Message", "Step", "ToolCall", "ToolError", "Turn",
           "call_tools", "python", "tool_schema"]
