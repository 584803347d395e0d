import os
import socket
import time

import pytest

from alignflow.core.sandbox import UID_BASE, UID_SPAN
from alignflow.plugins.code_exec import CodeExec, extract_code

TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
CODE = "def add(a, b):\n    return a + b\n"
GOOD = f"Here:\n```python\n{CODE}```\n"


def sandbox_processes() -> list[int]:
    """Processes running under any sandbox uid."""
    uids = range(UID_BASE, UID_BASE + UID_SPAN)
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _uid(p) in uids]


def _uid(pid: str) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_uid
    except FileNotFoundError:
        return -1


def test_extract_code_takes_the_last_python_fence_else_everything():
    assert extract_code("```python\na = 1\n```\ntext\n```py\nb = 2\n```") == "b = 2\n"
    assert extract_code("x = 1") == "x = 1"


def test_fraction_and_all_or_nothing_scores():
    half_wrong = "def add(a, b):\n    return a + b if a > 0 else 7"
    reward = CodeExec(CodeExec.Config(wall_s=5))
    assert reward(["p"] * 2, [GOOD, half_wrong], tests=[TESTS, TESTS]) == [1.0, 2 / 3]
    strict = CodeExec(CodeExec.Config(score="all", wall_s=5))
    assert strict(["p"] * 2, [GOOD, half_wrong], tests=[TESTS, TESTS]) == [1.0, 0.0]


def test_a_test_script_string_is_one_test_and_no_tests_is_none():
    reward = CodeExec(CodeExec.Config(wall_s=5))
    script = "assert add(1, 1) == 2\nassert add(0, 5) == 5\n"
    assert reward(["p"] * 2, [GOOD, GOOD], tests=[script, []], answer=["x", "y"]) == [1.0, None]


def test_faking_success_does_not_pay():
    reward = CodeExec(CodeExec.Config(wall_s=5))
    fakes = [
        CODE + "import sys\nsys.exit(0)",  # exits before the tests run
        CODE + "import os\nos._exit(0)",
        "print('0 passed')\nprint('\\n'.join(f'{i}' for i in range(3)))",
    ]
    assert reward(["p"] * 3, fakes, tests=[TESTS] * 3) == [0.0, 0.0, 0.0]


def test_hostile_samples_score_zero_in_bounded_time_next_to_a_correct_one():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        hostile = {
            "loop": "while True: pass",
            "sleep": "import time\ntime.sleep(60)",
            "fork bomb": "import os\nwhile True:\n    os.fork()",
            "10 GB": "x = bytearray(10 * 2**30)\n" + CODE,
            "socket": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\n" + CODE,
            "read /root": "open('/root/.bashrc').read()\n" + CODE,
            "huge file": "f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)",
        }
        completions = [GOOD, *hostile.values(), GOOD]
        reward = CodeExec(CodeExec.Config(workers=4, cpu_s=1, wall_s=3, processes=16))
        start = time.monotonic()
        scores = reward(["p"] * len(completions), completions, tests=[TESTS] * len(completions))
        elapsed = time.monotonic() - start
        with pytest.raises(BlockingIOError):
            server.accept()
    assert scores == [1.0] + [0.0] * len(hostile) + [1.0], dict(zip(["good", *hostile, "good"], scores))
    assert elapsed < 15  # 9 samples, 4 at a time, each capped at a 3 s wall clock
    if os.geteuid() == 0:
        assert sandbox_processes() == []


def test_registered_with_a_validated_config():
    import alignflow.plugins.code_exec as module
    from alignflow.core.plugins import Plugins
    from alignflow.core.spec import validate_config

    plugins = Plugins()
    plugins.add(module, "code_exec", "alignflow")
    assert plugins.rewards.get("code_exec") is CodeExec
    with pytest.raises(Exception, match="score"):
        validate_config(CodeExec, {"score": "most"}, "code_exec.config")


def test_a_broken_sandbox_gives_none_not_zero(monkeypatch):
    import alignflow.core.sandbox as sandbox

    broken = sandbox.BOOTSTRAP.replace("resource.setrlimit(", "resource.nope(")
    monkeypatch.setattr(sandbox, "BOOTSTRAP", broken)
    assert CodeExec()(["p"], [GOOD], tests=[TESTS]) == [None]
