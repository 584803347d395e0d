"""Tools: plain functions with a JSON schema from their signature and docstring; tool calls parsed from a
model turn in its chat template's format; calls run so that nothing a model writes can crash a stage."""

from __future__ import annotations

import contextlib
import inspect
import json
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable

Message = dict[str, Any]  # {"role": "user" | "tool" | "system" | "assistant", "content": str, ...}


@dataclass
class ToolCall:
    """A tool call parsed from a model turn; `error` says why it cannot be run (malformed, unknown tool)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


class ToolError(Exception):
    """A tool's own report that a call failed (bad input, a server's error result, no answer in time): the model
    reads `error: NAME: message`."""


JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable[..., Any]) -> dict[str, Any]:
    """The OpenAI/Hermes function schema of `fn`: a tool object's own `schema` (an MCP or OpenEnv server's tool),
    else its name, its docstring's first paragraph, one property per parameter (the JSON type of its annotation;
    its description from an `Args:` section), those without a default required."""
    if isinstance(getattr(fn, "schema", None), dict):
        return fn.schema
    doc = inspect.getdoc(fn) or ""
    summary = doc.split("\n\n", 1)[0].replace("\n", " ").strip()
    described = _arg_docs(doc)
    hints = typing.get_type_hints(fn)
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        prop = {"type": JSON_TYPES.get(typing.get_origin(hints.get(name)) or hints.get(name), "string")}
        if name in described:
            prop["description"] = described[name]
        properties[name] = prop
        if p.default is p.empty:
            required.append(name)
    return {"type": "function", "function": {"name": fn.__name__, "description": summary,
                                             "parameters": {"type": "object", "properties": properties,
                                                            "required": required}}}


def _arg_docs(doc: str) -> dict[str, str]:
    """`name: text` lines of a Google-style `Args:` section."""
    section = re.search(r"^\s*Args:\s*\n(.*?)(?:\n\s*\n|\Z)", doc, re.S | re.M)
    if not section:
        return {}
    return {m[1]: m[2].strip() for m in re.finditer(r"^\s*(\w+)(?:\s*\([^)]*\))?:\s*(.+)$", section[1], re.M)}


@dataclass(frozen=True)
class ToolFormat:
    """How a model writes tool calls and how a tool's result reads back to it."""

    name: str
    call: re.Pattern  # one match per call; group 1: its body
    opener: str  # the start of a call: an opener without its closer is a malformed call

    def parse(self, text: str, tools: dict[str, dict]) -> list[ToolCall]:
        """Every call in `text`, in order; a malformed one (bad JSON, no name, unclosed) carries its error."""
        calls = [self._one(m[1], tools) for m in self.call.finditer(text)]
        if text.count(self.opener) > len(calls):
            calls.append(ToolCall("", {}, f"malformed tool call: {self.opener} without its end"))
        return calls

    def _one(self, body: str, tools: dict[str, dict]) -> ToolCall:
        if self.name == "hermes":
            try:
                call = json.loads(body)
            except json.JSONDecodeError as exc:
                return ToolCall("", {}, f"malformed tool call: not JSON ({exc.msg})")
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return ToolCall("", {}, 'malformed tool call: expected {"name": ..., "arguments": {...}}')
            args = call.get("arguments", {})
            if isinstance(args, str):  # some models write the arguments as a JSON string
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    return ToolCall(call["name"], {}, "malformed tool call: arguments are not JSON")
            if not isinstance(args, dict):
                return ToolCall(call["name"], {}, "malformed tool call: arguments must be an object")
            return ToolCall(call["name"], args)
        name, _, arg = body.strip().partition(" ")  # tag form: `<call>NAME ARGUMENT</call>`
        if not name:
            return ToolCall("", {}, "malformed tool call: no tool name")
        arg = arg.strip()
        if arg.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return ToolCall(name, json.loads(arg))
        parameters = tools.get(name, {}).get("function", {}).get("parameters", {})
        params = parameters.get("required", [])
        if not params:
            return ToolCall(name, {"input": arg} if arg else {})
        kind = parameters.get("properties", {}).get(params[0], {}).get("type", "string")
        try:  # the bare argument as its parameter's JSON type: `<call>add 2</call>` gives an integer 2
            return ToolCall(name, {params[0]: _typed(arg, kind)})
        except ValueError:
            return ToolCall(name, {}, f"malformed tool call: {name} takes {params[0]} as JSON type {kind}, got {arg!r}")

    def result(self, message: Message) -> Message:
        """A tool message as this format shows it: the template wraps Hermes results; the tag form, the text."""
        if self.name == "hermes":
            return message
        return {**message, "content": f"<result>{message['content']}</result>"}


def _typed(text: str, kind: str) -> Any:
    """A tag-form argument as JSON type `kind` (a ValueError if it is not one); strings and unknown types as
    written."""
    if kind == "integer":
        return int(text)
    if kind == "number":
        return float(text)
    if kind == "boolean":
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if kind in ("array", "object"):
        value = json.loads(text)  # a JSONDecodeError is a ValueError
        if not isinstance(value, list if kind == "array" else dict):
            raise ValueError(text)
        return value
    return text


FORMATS = {
    # Qwen2.5 / Hermes chat templates: <tool_call>{"name": "f", "arguments": {...}}</tool_call>
    "hermes": ToolFormat("hermes", re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S), "<tool_call>"),
    # the built-in tiny model (its template has no tool support): <call>f ARGUMENT</call>, answered <result>...</result>
    "tag": ToolFormat("tag", re.compile(r"<call>(.*?)</call>", re.S), "<call>"),
}


def tool_format(name: str, tokenizer=None) -> ToolFormat:
    """Format `name`; `auto`: Hermes when the tokenizer's chat template knows tool calls, else the tag form."""
    if name == "auto":
        template = getattr(tokenizer, "chat_template", None) or ""
        name = "hermes" if "tool_call" in template else "tag"
    return FORMATS[name]


def call_tools(tools: list[Callable[..., Any]], calls: list[ToolCall]) -> tuple[list[Message], int]:
    """Each call's result as a `tool` message, and how many failed. A malformed call, an unknown tool, wrong
    arguments or a tool that raises (a `ToolError` among others) answers with an error the model can read;
    nothing is raised. A tool is a function or an object with `__name__`, `schema` and `__call__`."""
    by_name = {fn.__name__: fn for fn in tools}
    messages, errors = [], 0
    for call in calls:
        text, failed = _run(by_name, call)
        errors += failed
        messages.append({"role": "tool", "name": call.name, "content": text})
    return messages, errors


def _run(by_name: dict[str, Callable], call: ToolCall) -> tuple[str, bool]:
    if call.error:
        return f"error: {call.error}", True
    fn = by_name.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(by_name)) or 'none'})", True
    try:
        if getattr(fn, "schema", None) is None:  # a tool with its own schema checks its arguments itself
            inspect.signature(fn).bind(**call.arguments)
    except TypeError as exc:
        return f"error: {call.name}: {exc}", True
    try:
        result = fn(**call.arguments)
    except ToolError as exc:
        return f"error: {call.name}: {exc}", True
    except Exception as exc:  # the model's call failed, not the stage
        return f"error: {call.name} raised {type(exc).__name__}: {exc}", True
    return (result if isinstance(result, str) else json.dumps(result)), False


def python(code: str) -> str:
    """Run Python code in the sandbox (no network, 5 s of CPU) and return what it prints.

    Args:
        code: the program; print what you want to see.
    """
    from alignflow.core.sandbox.runner import Limits, run_python

    result = run_python(code, Limits(cpu_s=5, wall_s=10.0, output_bytes=4 << 10))
    if result.timed_out:
        raise TimeoutError("the program ran past 10 s")
    if result.returncode != 0:  # the call failed: an error observation, counted
        raise RuntimeError(f"exit {result.returncode}: {result.stderr.strip()[-1000:]}")
    return result.stdout.strip()
