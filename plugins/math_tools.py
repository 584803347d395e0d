"""math_tools environment: a math problem, tools to call as often as needed (a calculator, Python), then an
answer in `<answer>...</answer>`, scored against the row's `answer` as `math_accuracy` scores it."""

from __future__ import annotations

import ast
import operator
from typing import Literal

from alignflow.core import PluginConfig, hookimpl, pyast
from alignflow.core.environments import Environment, python
from alignflow.plugins.math_accuracy import extract_answer, is_equivalent

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg,
       ast.UAdd: operator.pos}
MAX_DIGITS = 100  # an answer no longer than this: `9**9**9` style blow-ups are refused, not computed


def calculator(expression: str) -> str:
    """Evaluate an integer expression with + - * and parentheses.

    Args:
        expression: for example 37*(12-5)
    """
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            out = OPS[type(node.op)](value(node.left), value(node.right))
        elif isinstance(node, ast.UnaryOp) and type(node.op) in OPS:
            out = OPS[type(node.op)](value(node.operand))
        else:
            raise ValueError(f"not an integer expression of + - * and parentheses: {expression!r}")
        if abs(out) >= 10 ** MAX_DIGITS:
            raise ValueError(f"the result has more than {MAX_DIGITS} digits")
        return out

    return str(value(pyast.parse(expression.strip(), mode="eval").body))  # episodes step in threads


TOOLS = {"calculator": calculator, "python": python}


class MathTools(Environment):
    """A math problem with tools (calculator, python); the turn without a tool call is the answer."""

    class Config(PluginConfig):
        # calculator: integer + - * and parentheses; python: a sandboxed Python snippet
        tools: list[Literal["calculator", "python"]] = ["calculator"]

    def reset(self, row: dict, seed: int) -> str:
        if row.get("answer") is None:  # a stage's rows need `answer` only where it is read: here it is
            raise KeyError("math_tools scores against the row's `answer` column, which this row lacks")
        self.answer = str(row["answer"])
        return row["prompt"]

    def tools(self):
        return [TOOLS[name] for name in self.config.tools]

    def score(self, answer: str) -> float:
        pred = extract_answer(answer)
        return float(pred is not None and is_equivalent(pred, self.answer))


@hookimpl
def register_environments(register):
    register("math_tools", MathTools)
