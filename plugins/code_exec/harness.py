"""What `code_exec` runs inside the sandbox: load the solution, then answer the scorer's requests.

Sent as source to the sandbox's interpreter (Python 3.8+, stdlib only), where the bootstrap gives it
`send` and `recv`. It never sees a test or an expected value and never reports a verdict: it calls
what it is asked to call and returns the value, reduced to plain builtin data (None, bool, int,
float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset) by the builtin types' own
methods, so an `int` subclass arrives as its integer and an object with an always-true `__eq__`
arrives as an opaque handle the scorer never compares equal to anything. Everything it uses is bound
before the solution exists; a solution that tampers with it can only make its own answers wrong.
"""

import builtins
import io
import os
import sys


def serve(send, recv):
    # Bound now, before untrusted code runs: later rebinding of builtins does not reach these.
    _type, _issub, _len, _range, _iter, _next = type, issubclass, len, range, iter, next
    _repr, _str_, _bool, _getattr, _exc = repr, str, bool, getattr, BaseException
    base = [bool, int, float, complex, str, bytes, bytearray, list, tuple, dict, set, frozenset]
    B, I, F, C, S, BY, BA, L, T, D, ST, FS = base
    MAX_DEPTH, MAX_ITEMS, BIG = 100, 1000000, 1 << 8192
    handles, handle_of = {}, {}

    class Unreportable(Exception):
        pass

    def handle(x):
        key = id(x)
        if key not in handle_of:
            handle_of[key] = len(handles)
            handles[len(handles)] = x  # kept alive, so its id is never reused
        return {"h": [handle_of[key], _type.__getattribute__(_type(x), "__name__")]}

    def reduce(x, depth=0, budget=None):
        budget = budget if budget is not None else [MAX_ITEMS]
        budget[0] -= 1
        if depth > MAX_DEPTH or budget[0] < 0:
            raise Unreportable("too deep or too large")
        t = _type(x)
        if x is None or t is B:
            return x
        kind = _next((b for b in base if _issub(t, b)), None)
        if kind is None:
            return handle(x)
        d = depth + 1
        if kind is I:
            x = I.__index__(x)
            return x if -BIG < x < BIG else {"i": I.__format__(x, "x")}  # decimal text is capped
        if kind is F:
            return F.__float__(x)
        if kind is C:
            return {"c": [C.__getattribute__(x, "real"), C.__getattribute__(x, "imag")]}
        if kind is S:
            return S.__str__(x)
        if kind is BY:
            return {"b": BY.hex(x)}
        if kind is BA:
            return {"ba": BA.hex(x)}
        if kind is L:
            return {"l": [reduce(v, d, budget) for v in L.copy(x)]}
        if kind is T:
            return {"t": [reduce(T.__getitem__(x, i), d, budget) for i in _range(T.__len__(x))]}
        if kind is D:
            return {"d": [[reduce(k, d, budget), reduce(v, d, budget)] for k, v in D.items(D.copy(x))]}
        items = [reduce(v, d, budget) for v in (ST.copy(x) if kind is ST else FS.__iter__(x))]
        return {"s" if kind is ST else "fs": items}

    def expand(v):
        """Request data (trusted, from the scorer) back to objects; handles to the objects they name."""
        if not isinstance(v, dict):
            return v
        (tag, x), = v.items()
        if tag == "h":
            return handles[x]
        if tag == "n":
            return namespace[x]
        if tag == "i":
            return int(x, 16)
        if tag == "l":
            return [expand(i) for i in x]
        if tag == "t":
            return tuple(expand(i) for i in x)
        if tag == "d":
            return {expand(k): expand(i) for k, i in x}
        if tag == "s":
            return {expand(i) for i in x}
        if tag == "fs":
            return frozenset(expand(i) for i in x)
        if tag == "b":
            return bytes.fromhex(x)
        if tag == "ba":
            return bytearray.fromhex(x)
        if tag == "c":
            return complex(*x)
        raise ValueError("unknown tag %r" % tag)

    def reply(value=None, **extra):
        try:
            send(dict(value=reduce(value), **extra))
        except Unreportable as exc:
            send({"raised": "Unreportable", "message": _str_(exc)})

    def raised(exc):
        send({"raised": _type.__getattribute__(_type(exc), "__name__")})

    def resolve(ref):
        obj = namespace[ref["name"]] if "name" in ref else handles[ref["h"]]
        return _getattr(obj, ref["attr"]) if "attr" in ref else obj

    null = open(os.devnull, "w")
    os.dup2(null.fileno(), 1)  # what the solution prints is nobody's business, and never a verdict
    os.dup2(null.fileno(), 2)
    sys.stdin, sys.stdout, sys.stderr = io.StringIO(""), null, null
    namespace = {"__name__": "solution", "__builtins__": builtins}

    def run_program(code, stdin):
        """Run `code` as a program on `stdin` (fd 0 and sys.stdin); what it wrote to fd 1 or sys.stdout."""
        import tempfile
        with tempfile.TemporaryFile() as given, tempfile.TemporaryFile() as taken:
            given.write(stdin.encode())
            given.seek(0)
            os.dup2(given.fileno(), 0)
            os.dup2(taken.fileno(), 1)
            sys.stdin, sys.stdout = open(0, "r", closefd=False), open(1, "w", closefd=False)
            error = None
            try:
                exec(compile(code, "main.py", "exec"), {"__name__": "__main__", "__builtins__": builtins})
            except SystemExit:
                pass
            except _exc as exc:
                error = _type.__getattribute__(_type(exc), "__name__")
            try:
                sys.stdout.flush()
            except _exc:
                pass
            os.dup2(null.fileno(), 1)
            sys.stdin, sys.stdout = io.StringIO(""), null
            taken.seek(0)
            return {"stdout": taken.read(4 << 20).decode("utf-8", "replace"), "raised": error}

    def check(op, left, right=None):  # the asserts of a test that had to run here (see the scorer)
        try:
            message = {"check": op, "left": reduce(left), "right": reduce(right)}
        except Unreportable:
            message = {"check": op, "left": {"h": [-1, "?"]}, "right": None}
        send(message)
        if not recv().get("ok"):
            raise AssertionError(op)

    while True:
        request = recv()
        op = request["op"]
        try:
            if op == "load":
                exec(compile(request["code"], "solution.py", "exec"), namespace)
                names = {}
                for name, value in list(namespace.items()):
                    if name.startswith("__"):
                        continue
                    if _type(value) is _type(os):
                        names[name] = "module " + _str_(_getattr(value, "__name__", ""))
                    else:
                        names[name] = "callable" if callable(value) else "value"
                send({"names": names})
            elif op == "get":
                reply(resolve(request["ref"]))
            elif op == "call":
                args = [expand(a) for a in request["args"]]
                kwargs = {k: expand(a) for k, a in request["kwargs"].items()}
                value = resolve(request["ref"])(*args, **kwargs)
                after = [reduce(a) if _type(a) in (L, D, ST, BA) else None for a in args]
                reply(value, after=after)
            elif op == "len":
                reply(_len(resolve(request["ref"])))
            elif op == "bool":
                reply(_bool(resolve(request["ref"])))
            elif op == "str":
                reply(_str_(resolve(request["ref"])))
            elif op == "iter":
                it, items = _iter(resolve(request["ref"])), []
                for _ in _range(MAX_ITEMS):
                    try:
                        items.append(_next(it))
                    except StopIteration:
                        break
                reply(items)
            elif op == "getitem":
                reply(resolve(request["ref"])[expand(request["key"])])
            elif op == "io":
                send(run_program(request["code"], request["stdin"]))
            elif op == "test":
                scope = dict(namespace, __alignflow_check__=check)
                exec(compile(request["code"], "test.py", "exec"), scope)
                send({"done": True})
            else:
                send({"raised": "UnknownRequest"})
        except _exc as exc:
            raised(exc)


serve(send, recv)  # noqa: F821 (given by the sandbox's bootstrap)
