"""Environments: multi-turn, tool-using episodes (the contract, tools, token-in/token-out transcripts, rollouts)."""

from alignflow.core.environments.contract import Environment, Message, Step, ToolCall, Turn
from alignflow.core.environments.tools import call_tools, python, tool_schema

__all__ = ["Environment", "Message", "Step", "ToolCall", "Turn", "call_tools", "python", "tool_schema"]
