import os
import signal
import socket
import tempfile
import time
from pathlib import Path

import pytest

from alignflow.core.sandbox import Limits, processes_of, run_python

FAST = Limits(cpu_s=1, wall_s=3.0, memory_bytes=512 << 20, file_bytes=1 << 20, processes=8)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop and per-run uids need root")


def run(code: str, limits: Limits = FAST):
    result = run_python(code, limits)
    if result.uid is not None:
        assert processes_of(result.uid) == [], "a sandbox process outlived its run"
    return result


def test_runs_in_a_fresh_folder_with_an_empty_environment():
    os.environ["ALIGNFLOW_SECRET_TEST"] = "leak"
    code = "import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.listdir('.')]))"
    result = run(code)
    assert result.ok, result.stderr
    import json

    env, cwd, files = json.loads(result.stdout)
    assert set(env) <= {"LC_CTYPE"}  # Python's own locale coercion; nothing of the parent's
    assert files == ["main.py"] and not Path(cwd).exists()  # the folder is removed afterwards


@as_root
def test_user_code_runs_unprivileged():
    result = run("import os; print(os.getresuid(), os.getresgid(), os.getgroups())")
    uid = result.uid
    assert result.stdout.strip() == f"({uid}, {uid}, {uid}) ({uid}, {uid}, {uid}) []"


def test_infinite_loop_is_stopped_by_the_cpu_limit():
    result = run("while True: pass", Limits(cpu_s=1, wall_s=30))  # a wall clock that a busy host cannot hit
    assert result.returncode == -signal.SIGXCPU and not result.timed_out  # CPU limit, not the wall clock


def test_sleeping_forever_is_stopped_by_the_wall_clock():
    result = run("import time; time.sleep(60)", Limits(wall_s=1.0))
    assert result.timed_out and 1.0 <= result.seconds < 2.0


def test_a_10_gb_allocation_fails():
    result = run("x = bytearray(10 * 2**30)\nprint('allocated')")
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


def test_huge_file_is_cut_at_the_size_limit():
    result = run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)")
    assert not result.ok and "File too large" in result.stderr


@as_root
def test_fork_bomb_is_capped_by_the_process_limit_and_fully_killed():
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError:\n    print('forks', n, flush=True)\n"
    )
    result = run(code)  # `run` checks that none of the sleeping children survived
    assert result.ok and 0 < int(result.stdout.split()[1]) < FAST.processes
    start = time.monotonic()
    assert not run("import os\nwhile True:\n    os.fork()").ok
    assert time.monotonic() - start < FAST.wall_s + 2


@as_root
def test_a_process_that_escapes_with_setsid_is_killed():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    assert run(code).ok  # `run` asserts the detached child is gone


def test_network_is_unreachable():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')"
        result = run(code)
        assert not result.ok and "in" not in result.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the listener


@as_root
def test_files_outside_the_folder_are_unreadable():
    folder = Path(tempfile.mkdtemp())
    secret = folder / "secret.txt"
    try:
        folder.chmod(0o755)  # reachable, so only the file's own 0600 mode protects it
        secret.write_text("s3cret")
        secret.chmod(0o600)
        result = run(f"print(open({str(secret)!r}).read())")
        assert not result.ok and "PermissionError" in result.stderr and "s3cret" not in result.stdout
        assert "PermissionError" in run("import os\nprint(os.listdir('/root'))").stderr
    finally:
        secret.unlink(missing_ok=True)
        folder.rmdir()


def test_output_comes_back_as_a_bounded_tail():
    result = run("print('x' * 100000)\nprint('end')", Limits(output_bytes=1000))
    assert len(result.stdout) == 1000 and result.stdout.endswith("end\n")


def test_without_a_network_namespace_sockets_are_disabled(monkeypatch):
    import alignflow.core.sandbox as sandbox

    no_namespaces = sandbox.BOOTSTRAP.replace("libc.unshare(", "-1 == (")  # as on a locked-down host
    monkeypatch.setattr(sandbox, "BOOTSTRAP", no_namespaces)
    code = (
        "import socket, urllib.request\n"  # urllib imports ssl, which subclasses socket.socket
        "connect = lambda: socket.create_connection(('127.0.0.1', 1))\n"
        "for open_one in (socket.socket, socket.socketpair, connect):\n"
        "    try:\n        open_one()\n        print('open')\n"
        "    except PermissionError:\n        print('blocked')\n"
    )
    result = run(code)
    assert result.ok, result.stderr
    assert result.stdout.split() == ["blocked"] * 3


def test_a_failed_setup_is_a_sandbox_error_not_a_failed_program(monkeypatch):
    import alignflow.core.sandbox as sandbox

    broken = sandbox.BOOTSTRAP.replace("resource.setrlimit(", "resource.nope(")
    monkeypatch.setattr(sandbox, "BOOTSTRAP", broken)
    with pytest.raises(sandbox.SandboxError, match="could not be set up.*nope"):
        run_python("print('never runs')", FAST)
