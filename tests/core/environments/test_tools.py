"""Tools: schemas from signatures and docstrings, calls parsed in both formats, failures as observations."""

from alignflow.core.environments import ToolCall, ToolError, call_tools, tool_schema
from alignflow.core.environments.tools import FORMATS, tool_format
from alignflow.core.task.tokenizer import build_char_tokenizer
from alignflow.plugins.math_tools import calculator


def lookup(city: str, days: int = 1, metric: bool = True) -> str:
    """Forecast for a city.

    Longer text that is not the summary.

    Args:
        city: the city's name
        days (int): how many days ahead
    """
    return f"{city}:{days}:{metric}"


def boom(x: str) -> str:
    """Always fails."""
    raise ValueError("no luck")


def test_schema_from_signature_and_docstring():
    s = tool_schema(lookup)
    assert s == {"type": "function", "function": {
        "name": "lookup", "description": "Forecast for a city.",
        "parameters": {"type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "days": {"type": "integer", "description": "how many days ahead"},
            "metric": {"type": "boolean"}}}}}


def test_hermes_calls_parsed_in_order_and_malformed_ones_carry_their_error():
    text = ('<tool_call>{"name": "lookup", "arguments": {"city": "Oslo"}}</tool_call> then '
            '<tool_call>{"name": "lookup", "arguments": "{\\"city\\": \\"Rome\\", \\"days\\": 2}"}</tool_call>'
            '<tool_call>{"name": lookup}</tool_call><tool_call>[1]</tool_call><tool_call>{"name": "x"')
    calls = FORMATS["hermes"].parse(text, {})
    assert [(c.name, c.arguments) for c in calls[:2]] == [("lookup", {"city": "Oslo"}),
                                                          ("lookup", {"city": "Rome", "days": 2})]
    assert "not JSON" in calls[2].error and "expected" in calls[3].error and "without its end" in calls[4].error
    assert len(calls) == 5 and all(c.error is None for c in calls[:2])


def test_tag_calls_map_a_bare_argument_to_the_first_required_parameter():
    tools = {"calculator": tool_schema(calculator)}
    calls = FORMATS["tag"].parse("<think>x</think><call>calculator 12*(3+4)</call><call>calculator {\"expression\": "
                                 "\"1+1\"}</call><call></call>", tools)
    assert [(c.name, c.arguments, c.error) for c in calls] == [
        ("calculator", {"expression": "12*(3+4)"}, None), ("calculator", {"expression": "1+1"}, None),
        ("", {}, "malformed tool call: no tool name")]


def add(x: int, y: int = 1) -> int:
    """Add y to x."""
    return x + y


def flags(on: bool) -> str:
    """Echo a flag."""
    return f"{on!r}"


def test_a_tag_forms_bare_argument_takes_its_parameters_json_type():
    tools = {"add": tool_schema(add), "flags": tool_schema(flags)}
    calls = FORMATS["tag"].parse("<call>add 2</call><call>add -7</call><call>add two</call><call>add 2.5</call>"
                                 "<call>flags True</call><call>flags yes</call>", tools)
    assert [(c.arguments, c.error) for c in calls] == [
        ({"x": 2}, None), ({"x": -7}, None),
        ({}, "malformed tool call: add takes x as JSON type integer, got 'two'"),
        ({}, "malformed tool call: add takes x as JSON type integer, got '2.5'"),
        ({"on": True}, None), ({}, "malformed tool call: flags takes on as JSON type boolean, got 'yes'")]
    messages, errors = call_tools([add, flags], calls)
    assert [m["content"] for m in messages[:2]] + [messages[4]["content"]] == ["3", "-6", "True"]  # "2" + 1 raised
    assert errors == 3 and messages[2]["content"].startswith("error: malformed tool call: add takes x")


def test_format_auto_follows_the_chat_template():
    tok = build_char_tokenizer()
    assert tool_format("auto", tok).name == "tag"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{# <tool_call> #}"
    assert tool_format("auto", tok).name == "hermes"


def test_every_failure_is_an_observation_and_counted():
    calls = [ToolCall("lookup", {"city": "Oslo", "days": 3}), ToolCall("nope", {}), ToolCall("lookup", {"town": "x"}),
             ToolCall("boom", {"x": "1"}), ToolCall("", {}, "malformed tool call: no tool name")]
    messages, errors = call_tools([lookup, boom], calls)
    assert errors == 4
    assert [m["content"] for m in messages] == [
        "Oslo:3:True",
        "error: unknown tool 'nope' (tools: boom, lookup)",
        "error: lookup: missing a required argument: 'city'",
        "error: boom raised ValueError: no luck",
        "error: malformed tool call: no tool name"]
    assert all(m["role"] == "tool" for m in messages)


def test_calculator_refuses_what_is_not_integer_arithmetic():
    assert calculator(" 37*(12-5) ") == "259" and calculator("-3+-4") == "-7"
    messages, errors = call_tools([calculator], [ToolCall("calculator", {"expression": "__import__('os')"}),
                                                 ToolCall("calculator", {"expression": "9**9**9"}),
                                                 ToolCall("calculator", {"expression": "2.5*2"})])
    assert errors == 3 and all("raised ValueError" in m["content"] for m in messages)


class Lookup:
    """A tool object with a schema of its own (as an MCP server's tools are): shown as declared, called by keyword."""

    __name__ = "lookup"
    schema = {"type": "function", "function": {"name": "lookup", "description": "A word's length.", "parameters": {
        "type": "object", "properties": {"word": {"type": "string", "minLength": 1}}, "required": ["word"]}}}

    def __call__(self, **arguments):
        if not arguments.get("word"):
            raise ToolError("`word` must be a non-empty string")
        return len(arguments["word"])


def test_a_tool_object_keeps_its_own_schema_and_a_tool_error_reads_as_its_message():
    assert tool_schema(Lookup()) is Lookup.schema
    messages, errors = call_tools([Lookup(), calculator], [ToolCall("lookup", {"word": "tools"}),
                                                           ToolCall("lookup", {"word": ""}),
                                                           ToolCall("calculator", {"expression": "2*3"})])
    assert [m["content"] for m in messages] == ["5", "error: lookup: `word` must be a non-empty string", "6"]
    assert errors == 1
