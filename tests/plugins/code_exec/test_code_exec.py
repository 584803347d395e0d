import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from alignflow.core.sandbox import runner as sandbox
from alignflow.core.rewards import RewardSet
from alignflow.core.sandbox.runner import UID_BASE, UID_SPAN, default_python
from alignflow.plugins.code_exec import CodeExec, extract_code

pytestmark = pytest.mark.system

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
CODE = "def add(a, b):\n    return a + b\n"
GOOD = f"Here:\n```python\n{CODE}```\n"
NAMESPACES = sandbox.namespaces_available(default_python())
needs_namespaces = pytest.mark.skipif(NAMESPACES is not None, reason=f"no namespace isolation: {NAMESPACES}")


def sandbox_processes() -> list[int]:
    """Processes running under any sandbox uid."""
    uids = range(UID_BASE, UID_BASE + UID_SPAN)
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid(p) in uids]


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return -1


def scores_of(samples: dict[str, str], tests=TESTS, **config) -> dict[str, float | None]:
    """Score each named completion next to a correct one at each end of the same batch."""
    reward = CodeExec(CodeExec.Config(**{"workers": 4, "cpu_s": 2, "wall_s": 5, **config}))
    completions = [GOOD, *samples.values(), GOOD]
    out = reward(["p"] * len(completions), completions, tests=[tests] * len(completions))
    assert out[0] == out[-1] == 1.0, out
    if os.geteuid() == 0:
        assert sandbox_processes() == []
    return dict(zip(samples, out[1:-1]))


def test_extract_code_takes_the_last_python_fence_else_everything():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("x = 1") == "x = 1"


def test_all_or_nothing_by_default_fraction_on_request():
    half_wrong = "def add(a, b):\n    return a + b if a > 0 else 7"
    assert CodeExec()(["p"] * 2, [GOOD, half_wrong], tests=[TESTS, TESTS]) == [1.0, 0.0]
    fraction = CodeExec(CodeExec.Config(score="fraction"))
    assert fraction(["p"] * 2, [GOOD, half_wrong], tests=[TESTS, TESTS]) == [1.0, 2 / 3]


def test_hidden_tests_are_scored_with_the_visible_ones():
    hardcoded = "def add(a, b):\n    return {(1, 2): 3, (-1, 1): 0, (2, 2): 4}.get((a, b), 0)"  # the visible answers
    reward = CodeExec(CodeExec.Config(score="fraction"))
    hidden = [["assert add(10, 5) == 15"]] * 2
    assert reward(["p"] * 2, [GOOD, hardcoded], tests=[TESTS] * 2, hidden_tests=hidden) == [1.0, 0.75]
    assert CodeExec()(["p"] * 2, [GOOD, hardcoded], tests=[TESTS] * 2, hidden_tests=hidden) == [1.0, 0.0]


def test_a_test_script_string_is_one_test_and_no_tests_is_none():
    script = "assert add(1, 1) == 2\nassert add(0, 5) == 5\n"
    assert CodeExec()(["p"] * 2, [GOOD, GOOD], tests=[script, []], answer=["x", "y"]) == [1.0, None]


def test_correct_solutions_pass_every_test_form():
    forms = {
        "equality": (CODE, ["assert add(1, 2) == 3"]),
        "truth": ("def even(n):\n    return n % 2 == 0", ["assert even(4)", "assert not even(3)"]),
        "tolerance": ("def half(x):\n    return x / 2", ["assert abs(half(1) - 0.5) < 1e-9",
                                                       "import math\nassert math.isclose(half(3), 1.5)"]),
        "membership": ("def pick():\n    return 2", ["assert pick() in (1, 2)"]),
        "test function": (CODE, ["def check(candidate):\n    assert candidate(1, 2) == 3\n"
                                 "    assert candidate(0, 0) == 0\n\ncheck(add)"]),
        "stdin/stdout": ("a, b = map(int, input().split())\nprint(a + b)",
                         [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10  \n\n"}]),
        "stdin via fd 0": ("print(sum(map(int, open(0).read().split())))", [{"input": "1 2 3", "output": "6"}]),
        "class": ("class Stack:\n    def __init__(self):\n        self.items = []\n    def push(self, x):\n"
                  "        self.items.append(x)\n    def pop(self):\n        return self.items.pop()\n"
                  "    def __len__(self):\n        return len(self.items)",
                  ["s = Stack()\ns.push(1)\ns.push(2)\nassert len(s) == 2\nassert s.pop() == 2\nassert s.items == [1]"]),
        "in place": ("def sort_it(xs):\n    xs.sort()", ["xs = [3, 1, 2]\nsort_it(xs)\nassert xs == [1, 2, 3]"]),
        "raises": ("def root(x):\n    if x < 0:\n        raise ValueError(x)\n    return x ** 0.5",
                   ["try:\n    root(-1)\n    assert False\nexcept ValueError:\n    pass", "assert root(4) == 2"]),
        "a lambda argument": ("def apply(f, x):\n    return f(x)", ["assert apply(lambda v: v + 1, 1) == 2"]),
        "method of a class": ("class Solution:\n    def two(self, xs):\n        return sorted(xs)[:2]",
                              ["assert Solution().two([5, 1, 3]) == [1, 3]"]),
        "big int": ("import math\ndef fact(n):\n    return math.factorial(n)",
                    ["import math\nassert fact(3000) == math.factorial(3000)"]),
        "odd values": ("def echo(x):\n    return x", [
            "assert echo('a\"b\\\\c\\n\\x00\\ud800é') == 'a\"b\\\\c\\n\\x00\\ud800é'",
            "assert echo(float('inf')) == float('inf') and echo(-0.0) == 0.0",
            "v = {1: (2, {3}), 'k': b'\\xff', 'z': frozenset([1]), 'c': 1 + 2j, 'n': None}\nassert echo(v) == v"]),
        "generator": ("def gen(n):\n    for i in range(n):\n        yield i", ["assert list(gen(3)) == [0, 1, 2]"]),
        "main guard": (CODE + "if __name__ == '__main__':\n    print(add(int(input()), 1))", TESTS),
        "the solution's import": ("import math\ndef area(r):\n    return math.pi * r * r",
                                  ["assert math.isclose(area(2), 12.566, rel_tol=1e-3)"]),
    }
    reward = CodeExec(CodeExec.Config(workers=4))
    out = reward(["p"] * len(forms), [c for c, _ in forms.values()], tests=[t for _, t in forms.values()])
    assert dict(zip(forms, out)) == dict.fromkeys(forms, 1.0)
    wrong = {name: code.replace("return", "return None and") for name, (code, _) in forms.items() if "return" in code}
    out = reward(["p"] * len(wrong), list(wrong.values()), tests=[forms[n][1] for n in wrong])
    assert dict(zip(wrong, out)) == dict.fromkeys(wrong, 0.0)


def test_objects_that_claim_equality_score_zero():
    assert scores_of({
        "always equal": "class A:\n    def __eq__(self, other):\n        return True\n"
                        "def add(a, b):\n    return A()",
        "int subclass": "class I(int):\n    def __eq__(self, other):\n        return True\n"
                        "    __hash__ = int.__hash__\ndef add(a, b):\n    return I(0)",
        "str subclass": "class S(str):\n    def __eq__(self, other):\n        return True\n"
                        "    __hash__ = str.__hash__\ndef add(a, b):\n    return S('x')",
        "list subclass": "class L(list):\n    def __eq__(self, other):\n        return True\n"
                         "def add(a, b):\n    return L()",
    }) == dict.fromkeys(["always equal", "int subclass", "str subclass", "list subclass"], 0.0)
    shadows = "def abs(x):\n    return 0\ndef sorted(x):\n    return [1, 2]\nimport os as math\ndef half(x):\n    return 7"
    tests = ["assert abs(half(1) - 0.5) < 1e-9", "assert sorted(half(1)) == [1, 2]", "assert math.isclose(half(1), 0.5)"]
    reward = CodeExec(CodeExec.Config(score="fraction"))
    assert reward(["p"] * 2, ["import math\ndef half(x):\n    return x / 2", shadows], tests=[tests[::2]] * 2) == [1.0, 0.0]
    assert reward(["p"], [shadows], tests=[tests[1:2]]) == [0.0]  # its own builtins do not reach the tests
    everything = ("class X:\n    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = lambda s, o: True\n"
                  "    __ne__ = lambda s, o: False\n    __sub__ = __rsub__ = lambda s, o: 0\n"
                  "    __abs__ = lambda s: 0\n    __float__ = lambda s: 0.5\n    __bool__ = lambda s: True\n"
                  "def half(x):\n    return X()")
    tests = ["assert half(1) == 0.5", "assert abs(half(1) - 0.5) < 1e-9", "import math\nassert math.isclose(half(1), 0.5)",
             "assert not half(1) != 0.5", "assert half(1) < 1", "assert half(1) in (0.5,)"]
    good = "def half(x):\n    return x / 2"
    reward = CodeExec(CodeExec.Config(score="fraction"))
    assert reward(["p"] * 2, [good, everything], tests=[tests] * 2) == [1.0, 0.0]
    passes_lambda = "class A:\n    __eq__ = lambda s, o: True\ndef apply(f, x):\n    return A()"  # rewritten asserts
    tests = ["assert apply(lambda v: v + 1, 1) == 2"]
    assert reward(["p"] * 2, ["def apply(f, x):\n    return f(x)", passes_lambda], tests=[tests] * 2) == [1.0, 0.0]


def test_tampering_with_the_interpreter_scores_zero():
    assert scores_of({
        "patched builtins": "import builtins\nbuiltins.exec = builtins.compile = lambda *a, **k: None\n"
                            "builtins.isinstance = lambda *a: True\ndef add(a, b):\n    return 0",
        "frame walk for expected values": (
            "import gc, re, sys\ndef add(a, b):\n    found = []\n    f = sys._getframe()\n    while f:\n"
            "        found += [v for v in list(f.f_locals.values()) + list(f.f_globals.values())]\n        f = f.f_back\n"
            "    found += gc.get_objects()\n"
            "    for s in [x for x in found if isinstance(x, str)]:\n"
            "        m = re.search(r'add\\(%d, %d\\) == (-?\\d+)' % (a, b), s)\n"
            "        if m:\n            return int(m.group(1))\n    return -999"),
        "frame walk for the marker and the channel": (
            "import gc, re, sys, os\nmarks = [s for s in gc.get_objects() if isinstance(s, str) and re.fullmatch('[0-9a-f]{32}', s)]\n"
            "for m in marks:\n    print('\\n'.join(f'{m} {i}' for i in range(5)))\n"
            "sends = [f for f in gc.get_objects() if callable(f) and getattr(f, '__name__', '') == 'send']\n"
            "for send in sends:\n    for _ in range(5):\n        send({'value': True})\n        send({'ok': True})\n"
            "        send({'done': True})\nos._exit(0)"),
        "exit before the tests": CODE + "import os\nos._exit(0)",
        "print fake results": "print('3 passed')\nprint('\\n'.join(str(i) for i in range(3)))",
    }) == dict.fromkeys(["patched builtins", "frame walk for expected values",
                         "frame walk for the marker and the channel", "exit before the tests",
                         "print fake results"], 0.0)


def test_a_forged_setup_failure_is_scored_zero_not_skipped():
    forged = "import os, sys\nsys.stderr.write('sandbox setup failed: forged\\n')\nos._exit(125)"
    assert scores_of({"forged": forged}) == {"forged": 0.0}


def test_a_sample_never_runs_or_is_imported_in_the_scorer(capsys):
    """Module objects named like modules whose import exits or prints, and exits at import: each its own 0."""
    modules = ("import sys, types\nm = types.ModuleType('unittest.__main__')\nsys.modules['unittest.__main__'] = m\n"
               "z = types.ModuleType('this')\n")  # importing `unittest.__main__` exits; `this` prints
    samples = {
        "defines unittest.__main__": modules,
        "SystemExit at import": "raise SystemExit(0)\n" + CODE,
        "KeyboardInterrupt at import": "raise KeyboardInterrupt\n" + CODE,
        "sys.exit after the definitions": CODE + "import sys\nsys.exit(3)",
    }
    assert scores_of(samples) == dict.fromkeys(samples, 0.0)
    assert scores_of({"correct, with those modules": modules + CODE}) == {"correct, with those modules": 1.0}
    assert "unittest.__main__" not in sys.modules and "this" not in sys.modules
    assert "Beautiful is better" not in capsys.readouterr().out


def test_anything_raised_while_scoring_a_sample_is_its_own_zero(monkeypatch):
    import alignflow.plugins.code_exec as code_exec

    real = code_exec.run_tests

    def raising(solution, code, tests):  # as if handling the sample's result raised, past any Exception
        for marker, exc in [("# exits", SystemExit(1)), ("# interrupts", KeyboardInterrupt())]:
            if marker in code:
                raise exc
        return real(solution, code, tests)

    monkeypatch.setattr(code_exec, "run_tests", raising)
    samples = {"SystemExit": CODE + "# exits", "KeyboardInterrupt in a worker": CODE + "# interrupts"}
    assert scores_of(samples) == dict.fromkeys(samples, 0.0)


@needs_namespaces
def test_the_host_cannot_be_read_or_written_and_nothing_is_left():
    token = os.urandom(6).hex()
    with tempfile.NamedTemporaryFile("w", dir="/tmp", suffix=".answers") as answers:
        answers.write("3\n0\n4\n")  # another job's world-readable file with the expected answers
        answers.flush()
        os.chmod(answers.name, 0o644)
        leak = "        return a + b\n    return 0\n"  # a correct solution, paid only if it sees the host
        samples = {
            "reads another job's file": "def add(a, b):\n    ans = [int(x) for x in open(%r).read().split()]\n"
                                        "    return {(1, 2): ans[0], (-1, 1): ans[1], (2, 2): ans[2]}[(a, b)]" % answers.name,
            "reads /etc/passwd": "import os\ndef add(a, b):\n    if os.path.exists('/etc/passwd'):\n" + leak,
            "reads host /proc": "import os\ndef add(a, b):\n    for p in filter(str.isdigit, os.listdir('/proc')):\n"
                                "        if b'pytest' in open(f'/proc/{p}/cmdline', 'rb').read():\n            return a + b\n    return 0",
            "leaves files": "import os\nfor d in ['.', '/tmp', '/var/tmp', '/dev/shm']:\n    try:\n"
                            f"        open(os.path.join(d, 'left-{token}'), 'w').write('x')\n    except OSError:\n        pass\n"
                            "def add(a, b):\n    return 0",
            "fills /dev/shm": "try:\n    open('/dev/shm/fill', 'wb').write(b'x' * (200 << 20))\nexcept OSError:\n    pass\n"
                              "def add(a, b):\n    return open('/dev/shm/fill', 'rb').read(1) == b'y'",
        }
        assert scores_of(samples) == dict.fromkeys(samples, 0.0)
    assert not any(Path(d, f"left-{token}").exists() for d in ["/tmp", "/var/tmp", "/dev/shm"])
    assert not Path("/dev/shm/fill").exists()


@needs_namespaces
def test_many_small_files_stop_at_the_wall_clock_clean_up_included():
    flood = "i = 0\nwhile True:\n    open('f%d' % i, 'w').close()\n    i += 1"
    start = time.monotonic()
    assert scores_of({"many files": flood}, wall_s=3, cpu_s=30) == {"many files": 0.0}
    assert time.monotonic() - start < 2 * 3 + 3  # two waves of 4 workers; each sample within its 3 s


def test_resource_attacks_score_zero_in_bounded_time_next_to_a_correct_one():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        hostile = {
            "loop": "while True: pass",
            "sleep": "import time\ntime.sleep(60)",
            "fork bomb": "import os\nwhile True:\n    os.fork()",
            "memory bomb": "x = bytearray(10 * 2**30)\n" + CODE,
            "socket": "import socket\ndef add(a, b):\n"
                      f"    socket.create_connection(('127.0.0.1', {port}), timeout=2)\n    return a + b",
            "huge file": "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
        }
        start = time.monotonic()
        scores = scores_of(hostile, cpu_s=1, wall_s=3, processes=16)
        elapsed = time.monotonic() - start
        with pytest.raises(BlockingIOError):
            server.accept()
    assert scores == dict.fromkeys(hostile, 0.0)
    assert elapsed < 15  # 8 samples, 4 at a time, each capped at a 3 s wall clock


def test_states_are_counted_and_logged_as_reward_metrics():
    reward = CodeExec(CodeExec.Config(wall_s=2, cpu_s=5))
    samples = [GOOD, "import time\ntime.sleep(60)", "import os\nos._exit(3)", "def add(a, b) return", GOOD]
    tests = [TESTS, TESTS, TESTS, TESTS, []]
    out = reward(["p"] * 5, samples, tests=tests)
    assert out == [1.0, 0.0, 0.0, 0.0, None]
    assert out.counts == {"timeout": 1.0, "crash": 1.0, "error": 1.0, "unscored": 1.0}
    rewards = RewardSet.from_refs([("code_exec", 1.0, {"wall_s": 2})])
    metrics = rewards(["p"] * 5, samples, tests=tests).metrics
    assert metrics["reward/code_exec/timeout"] == 1.0 and metrics["reward/code_exec/unscored"] == 1.0
    assert metrics["reward/code_exec/none"] == 1.0


def test_malformed_tests_are_an_error_that_names_the_test():
    from alignflow.plugins.code_exec.checks import TestError

    reward = CodeExec()
    with pytest.raises(TestError, match=r"tests\[1\] is not valid Python"):
        reward.score_one(GOOD, ["assert add(1, 2) == 3", "assert add(1,"])
    with pytest.raises(TestError, match=r"tests\[0\].*needs string `input` and `output`"):
        reward.score_one(GOOD, [{"stdin": "1"}])


def test_registered_with_a_validated_config():
    import alignflow.plugins.code_exec as module
    from alignflow.core.plugins import Plugins
    from alignflow.core.spec.schema import validate_config

    plugins = Plugins()
    plugins.add(module, "code_exec", "alignflow")
    assert plugins.rewards.get("code_exec") is CodeExec
    with pytest.raises(Exception, match="score"):
        validate_config(CodeExec, {"score": "most"}, "code_exec.config")


@pytest.mark.parametrize("isolation", [pytest.param("namespaces", marks=needs_namespaces), "basic"])
def test_a_broken_sandbox_gives_none_not_zero(monkeypatch, isolation):
    broken = sandbox.BOOTSTRAP.replace("resource.setrlimit(", "resource.nope(")
    monkeypatch.setattr(sandbox, "BOOTSTRAP", broken)
    out = CodeExec(CodeExec.Config(isolation=isolation))(["p"], [GOOD], tests=[TESTS])
    assert out == [None] and out.counts["unscored"] == 1.0
