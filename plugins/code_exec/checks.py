"""The scorer's side of `code_exec`: tests run here, on values the sandboxed solution sends back.

A test is trusted code from the dataset. It runs in this process, in a namespace where each name the
solution defines is a proxy: calling one sends the call, its arguments as plain data, to the sandbox,
which answers with the result reduced to plain builtin data (`code_child`). The assert then compares
here, between values whose methods are the builtin types' own, and the expected side of a test never
reaches the sandbox. An object the solution returns that is not plain data arrives as a handle: its
attributes, methods, `len`, `iter`, `bool` and `str` are asked of the sandbox (they are the solution's
answers, like any return value), but it equals nothing except itself and has no arithmetic or order.

A test that passes something the sandbox cannot receive (a lambda, an object of a class the test
defines) runs inside the sandbox instead, with each `assert a <op> b` rewritten to send both sides,
reduced the same way, here for the comparison. Its expected values then do enter the sandbox, and a
solution that tampers with the interpreter could skip such a test's asserts; it needs at least one
comparison made here to pass.

Stdin/stdout tests (`{"input": ..., "output": ...}`) run the program on the input inside the sandbox;
its output is compared here, line by line with trailing whitespace ignored.
"""

from __future__ import annotations

import ast
import builtins
import importlib
import operator
from typing import Any

from alignflow.core import pyast
from alignflow.core.sandbox.runner import Sandbox, SampleError, SampleTimeout

BIG = 1 << 8192  # ints past this travel as hex: decimal text of more than 4300 digits is refused
EXCEPTIONS = {name: v for name, v in vars(builtins).items()
              if isinstance(v, type) and issubclass(v, Exception) and v.__module__ == "builtins"}
COMPARE = {ast.Eq: "==", ast.NotEq: "!=", ast.Lt: "<", ast.LtE: "<=", ast.Gt: ">", ast.GtE: ">=",
           ast.In: "in", ast.NotIn: "not in", ast.Is: "is", ast.IsNot: "is not"}
OPS = {"==": operator.eq, "!=": operator.ne, "<": operator.lt, "<=": operator.le, ">": operator.gt,
       ">=": operator.ge, "in": lambda a, b: a in b, "not in": lambda a, b: a not in b,
       "is": operator.is_, "is not": operator.is_not, "truth": lambda a, _: bool(a)}
# The modules a test may use through the solution's own `import`: this process's copies, named here, since
# importing a name the solution chose runs code in the scorer (`unittest.__main__` exits, `antigravity`
# opens a browser). Pure stdlib modules without side effects on import.
SHARED_MODULES = frozenset({
    "array", "bisect", "cmath", "collections", "collections.abc", "copy", "dataclasses", "datetime",
    "decimal", "enum", "fractions", "functools", "heapq", "itertools", "json", "math", "numbers",
    "operator", "os", "random", "re", "statistics", "string", "sys", "textwrap", "time", "typing",
    "unicodedata"})


class TestError(ValueError):
    """A test of the dataset is malformed (not Python, or an io case without input and output)."""


class NotPortable(Exception):
    """A test passed the solution something that cannot cross into the sandbox."""


class RemoteError(Exception):
    """The solution raised an exception of a class of its own (or a non-Exception one)."""


class Opaque:
    """A value the sandbox could only send as a handle, seen by a rewritten assert: it equals nothing."""

    __slots__ = ("type",)

    def __init__(self, type_name: str):
        self.type = type_name

    def __bool__(self) -> bool:
        raise TypeError(f"the truth of a {self.type} from the solution is not trusted")

    def __repr__(self) -> str:
        return f"<{self.type} from the solution>"


class Solution:
    """The solution in its sandbox, as the tests see it: one request at a time, in the run's wall clock."""

    def __init__(self, box: Sandbox):
        self.box = box
        self.dead: str | None = None  # "timeout" or "crash" once the channel has failed

    def request(self, **message: Any) -> dict:
        if self.dead:
            raise SampleError(f"the solution is gone ({self.dead})")
        try:
            self.box.send(message)
            reply = self.box.recv()
            if not isinstance(reply, dict):
                raise SampleError(f"a reply that is not an object: {type(reply).__name__}")
            return reply
        except SampleError as exc:
            self.dead = "timeout" if isinstance(exc, SampleTimeout) else "crash"
            raise

    def value(self, reply: dict, inert: bool = False) -> Any:
        """The reply's value, or the solution's exception raised here (a builtin class, else RemoteError)."""
        if "raised" in reply:
            name = str(reply["raised"])
            raise EXCEPTIONS.get(name, RemoteError)(f"the solution raised {name}")
        try:
            return self.decode(reply["value"], inert)
        except (AttributeError, KeyError, TypeError, ValueError, RecursionError) as exc:
            self.dead = "crash"
            raise SampleError(f"a malformed value: {exc!r}") from None

    def decode(self, v: Any, inert: bool = False) -> Any:
        if v is None or type(v) in (bool, int, float, str):
            return v
        (tag, x), = v.items()
        items = lambda: [self.decode(i, inert) for i in x]  # noqa: E731
        if tag == "h":
            return Opaque(str(x[1])) if inert else Remote(self, {"h": int(x[0])}, str(x[1]))
        decoders = {"l": lambda: items(), "t": lambda: tuple(items()), "s": lambda: set(items()),
                    "fs": lambda: frozenset(items()), "b": lambda: bytes.fromhex(x),
                    "ba": lambda: bytearray.fromhex(x), "c": lambda: complex(float(x[0]), float(x[1])),
                    "i": lambda: int(x, 16),
                    "d": lambda: {self.decode(k, inert): self.decode(i, inert) for k, i in x}}
        return decoders[tag]()

    def call(self, ref: dict, args: tuple, kwargs: dict) -> Any:
        reply = self.request(op="call", ref=ref, args=[encode(a) for a in args],
                             kwargs={str(k): encode(a) for k, a in kwargs.items()})
        value = self.value(reply)
        for arg, after in zip(args, reply.get("after") or []):  # in-place changes come back
            if after is not None and type(arg) in (list, dict, set, bytearray):
                new = self.decode(after)
                if type(new) is not type(arg):
                    raise SampleError("an argument changed type")
                if isinstance(arg, (list, bytearray)):
                    arg[:] = new
                else:
                    arg.clear()
                    arg.update(new)
        return value


def encode(v: Any) -> Any:
    """A test's argument as plain data for the sandbox; NotPortable for what cannot cross."""
    t = type(v)
    if v is None or t in (bool, str, float):
        return v
    if isinstance(v, int) and t is not bool:
        v = int(v)
        return v if -BIG < v < BIG else {"i": format(v, "x")}
    if isinstance(v, Remote):
        return {"n": v._ref["name"]} if set(v._ref) == {"name"} else dict(v._ref)
    containers = {list: "l", tuple: "t", set: "s", frozenset: "fs"}
    if t in containers:
        return {containers[t]: [encode(i) for i in v]}
    if t is dict:
        return {"d": [[encode(k), encode(i)] for k, i in v.items()]}
    if t in (bytes, bytearray):
        return {"b" if t is bytes else "ba": v.hex()}
    if t is complex:
        return {"c": [v.real, v.imag]}
    raise NotPortable(f"a {t.__name__} cannot be passed to the sandboxed solution")


class Remote:
    """A name the solution defines, or an object it returned: every use is a request to the sandbox."""

    __slots__ = ("_solution", "_ref", "_type")

    def __init__(self, solution: Solution, ref: dict, type_name: str):
        self._solution, self._ref, self._type = solution, ref, type_name

    def _ask(self, op: str, **extra: Any) -> Any:
        return self._solution.value(self._solution.request(op=op, ref=self._ref, **extra))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._solution.call(self._ref, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # dunders are this class's; `_x` names also guard a half-built proxy
            raise AttributeError(name)
        return self._solution.value(self._solution.request(op="get", ref={**self._ref, "attr": name}))

    def __len__(self) -> int:
        return self._ask("len")

    def __bool__(self) -> bool:
        return self._ask("bool") is True

    def __str__(self) -> str:
        return self._ask("str")

    def __iter__(self):
        return iter(self._ask("iter"))

    def __getitem__(self, key: Any) -> Any:
        return self._ask("getitem", key=encode(key))

    def __eq__(self, other: object) -> bool:  # the same object of the sandbox, and nothing else
        return isinstance(other, Remote) and other._ref == self._ref

    def __hash__(self) -> int:
        return hash(tuple(sorted(self._ref.items())))

    def __repr__(self) -> str:
        return f"<{self._type} from the solution>"


class _Asserts(ast.NodeTransformer):
    """`assert a <op> b` -> `__alignflow_check__("<op>", a, b)`; any other assert -> ("truth", test)."""

    def visit_Assert(self, node: ast.Assert) -> ast.AST:
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and type(t.ops[0]) in COMPARE:
            args = [ast.Constant(COMPARE[type(t.ops[0])]), t.left, t.comparators[0]]
        else:
            args = [ast.Constant("truth"), t]
        call = ast.Call(ast.Name("__alignflow_check__", ast.Load()), args, [])
        return ast.copy_location(ast.Expr(call), node)


def compare(op: str, left: Any, right: Any) -> bool:
    try:
        return bool(OPS[op](left, right))
    except Exception:
        return False


def run_inside(solution: Solution, source: str) -> bool:
    """A test that cannot be split, run in the sandbox with its asserts compared here."""
    tree = ast.fix_missing_locations(_Asserts().visit(pyast.parse(source)))
    reply = solution.request(op="test", code=ast.unparse(tree))
    checks, passed = 0, True
    while "check" in reply:
        op = str(reply["check"])
        good = op in OPS and compare(op, solution.decode(reply["left"], True), solution.decode(reply["right"], True))
        checks, passed = checks + 1, passed and good
        reply = solution.request(ok=good)
    return passed and checks > 0 and reply.get("done") is True


def same_output(got: str, expected: str) -> bool:
    lines = lambda s: [line.rstrip() for line in s.rstrip().splitlines()]  # noqa: E731
    return lines(got) == lines(expected)


def io_case(test: dict, i: int) -> tuple[str, str]:
    stdin, stdout = test.get("input", test.get("stdin")), test.get("output", test.get("stdout"))
    if not isinstance(stdin, str) or not isinstance(stdout, str):
        raise TestError(f"tests[{i}]: a stdin/stdout case needs string `input` and `output`, got keys {sorted(test)}")
    return stdin, stdout


def compile_test(test: Any, i: int) -> Any:
    if isinstance(test, dict):
        return io_case(test, i)
    if not isinstance(test, str):
        raise TestError(f"tests[{i}]: expected a Python snippet or an input/output case, got {type(test).__name__}")
    try:
        return compile(test, f"<test {i}>", "exec", optimize=0)  # asserts stay, even under python -O
    except SyntaxError as exc:
        raise TestError(f"tests[{i}] is not valid Python: {exc}") from None


def run_tests(solution: Solution, code: str, tests: list) -> tuple[list[bool], str]:
    """Each test's verdict, and the sample's state: ok, error (the solution did not load), timeout, crash."""
    compiled = [compile_test(t, i) for i, t in enumerate(tests)]
    namespace: dict[str, Any] | None = None
    verdicts, state = [], "ok"
    for test, item in zip(tests, compiled):
        passed = False
        try:
            if isinstance(item, tuple):
                reply = solution.request(op="io", code=code, stdin=item[0])
                passed = reply.get("raised") is None and same_output(str(reply.get("stdout")), item[1])
            else:
                if namespace is None:
                    namespace = load(solution, code)
                if namespace is not False:
                    passed = run_here(solution, test, item, namespace)
        except Exception:
            passed = False
        if namespace is False:
            state = "error"
        verdicts.append(passed and solution.dead is None)
    return verdicts, solution.dead or state


def load(solution: Solution, code: str) -> dict[str, Any] | bool:
    """The test namespace: a proxy for each name the solution defines; False if it did not load.

    Builtins are never shadowed (a solution's own `abs` or `sorted` would otherwise decide
    `assert abs(f(x) - y) < eps`), and a module the solution imported is this process's own copy of
    it, for the modules of `SHARED_MODULES` only (tests that use the solution's `import math`).
    """
    reply = solution.request(op="load", code=code)
    if not isinstance(reply.get("names"), dict):
        return False
    namespace: dict[str, Any] = {"__builtins__": builtins, "__name__": "__test__"}
    for name, kind in reply["names"].items():
        name, kind = str(name), str(kind)
        if not name.isidentifier() or name.startswith("__") or hasattr(builtins, name):
            continue
        try:
            if kind.startswith("module "):
                module = kind.removeprefix("module ")
                if module in SHARED_MODULES:  # never import a name only the solution gave
                    namespace[name] = importlib.import_module(module)
            elif kind == "callable":
                namespace[name] = Remote(solution, {"name": name}, "function")
            else:
                namespace[name] = solution.value(solution.request(op="get", ref={"name": name}))
        except (RemoteError, *EXCEPTIONS.values()):
            continue  # a value it cannot send: a test that uses it fails on the missing name
    return namespace


def run_here(solution: Solution, source: str, compiled: Any, namespace: dict) -> bool:
    try:
        exec(compiled, namespace)
        return True
    except NotPortable:
        return run_inside(solution, source)
    except Exception:
        return False
