import dataclasses
import json
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import pytest

from alignflow.core.sandbox import runner as sandbox
from alignflow.core.sandbox.cgroup import memory_parent
from alignflow.core.sandbox.runner import Limits, Sandbox, SandboxError, default_python, processes_of, run_python

pytestmark = pytest.mark.system

FAST = Limits(cpu_s=1, wall_s=3.0, memory_bytes=512 << 20, file_bytes=1 << 20, processes=8, scratch_bytes=4 << 20)
as_root = pytest.mark.skipif(os.geteuid() != 0, reason="privilege drop and per-run uids need root")
NAMESPACES = sandbox.namespaces_available(default_python())
needs_namespaces = pytest.mark.skipif(NAMESPACES is not None, reason=f"no namespace isolation: {NAMESPACES}")
MODES = [pytest.param("namespaces", marks=needs_namespaces), "basic"]


@pytest.fixture(params=MODES)
def isolation(request):
    return request.param


def run(code: str, isolation: str, limits: Limits = FAST):
    result = run_python(code, limits, isolation=isolation)
    assert result.isolation == isolation
    if result.uid is not None:
        assert processes_of(result.uid) == [], "a sandbox process outlived its run"
    return result


def test_runs_in_a_fresh_folder_with_an_empty_environment(isolation):
    os.environ["ALIGNFLOW_SECRET_TEST"] = "leak"
    code = "import os, json; print(json.dumps([dict(os.environ), os.getcwd(), os.listdir('.')]))"
    result = run(code, isolation)
    assert result.ok, result.stderr
    env, cwd, files = json.loads(result.stdout)
    assert set(env) <= {"LC_CTYPE", "PWD"}  # Python's locale coercion, bwrap's PWD; nothing of ours
    assert files == []
    if isolation == "basic":
        assert not Path(cwd).exists()  # the host folder is removed afterwards


@as_root
def test_user_code_runs_unprivileged_without_capabilities(isolation):
    code = ("import os\nprint(os.getresuid(), os.getresgid(), os.getgroups())\n"
            "status = dict(l.split(':\\t') for l in open('/proc/self/status').read().splitlines() if ':\\t' in l)\n"
            "print(status['CapPrm'], status['CapEff'], status['CapAmb'], status['NoNewPrivs'])")
    result = run(code, isolation)
    uid = result.uid
    lines = result.stdout.splitlines()
    assert lines[0] == f"({uid}, {uid}, {uid}) ({uid}, {uid}, {uid}) []"
    assert lines[1].split()[:3] == ["0000000000000000"] * 3
    if isolation == "namespaces":
        assert lines[1].split()[3] == "1"  # no_new_privs: no setuid binary gives privileges back


def test_infinite_loop_is_stopped_by_the_cpu_limit(isolation):
    result = run("while True: pass", isolation, Limits(cpu_s=1, wall_s=30))  # a wall clock a busy host cannot hit
    assert result.returncode == -signal.SIGXCPU and not result.timed_out  # CPU limit, not the wall clock


def test_sleeping_forever_is_stopped_by_the_wall_clock(isolation):
    result = run("import time; time.sleep(60)", isolation, Limits(wall_s=1.0))
    assert result.timed_out and 1.0 <= result.seconds < 2.0


def test_a_10_gb_allocation_fails(isolation):
    result = run("x = bytearray(10 * 2**30)\nprint('allocated')", isolation)
    assert not result.ok and "MemoryError" in result.stderr and "allocated" not in result.stdout


FOUR_FORKS = """
import os, select
ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
kids = []
for i in range(4):  # each child well under the per-process cap, all four together over the run's
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        block = bytearray(200 << 20)
        for j in range(0, len(block), 4096):
            block[j] = 1  # touched: resident, not only reserved
        os.write(ready_w, b"x")
        os.read(go_r, 1)  # hold it until every child has its block or was killed (EOF when the parent lets go)
        os._exit(0)
    kids.append(pid)
os.close(ready_w)
ready, codes = 0, {}
while ready + len(codes) < 4:
    if select.select([ready_r], [], [], 0.05)[0]:
        ready += len(os.read(ready_r, 4))
    for p in set(kids) - set(codes):
        got, status = os.waitpid(p, os.WNOHANG)
        if got:
            codes[p] = status
os.close(go_w)
codes = [codes[p] if p in codes else os.waitpid(p, 0)[1] for p in kids]
print("all allocated" if not any(codes) else "killed: " + str(codes))
"""
needs_cgroups = pytest.mark.skipif(memory_parent() is None,
                                   reason="no memory cgroup can be made here (not root, or not delegated)")


@needs_cgroups
def test_memory_is_capped_for_the_whole_run_not_per_process(isolation):
    """Four processes of 200 MB: under a 512 MB setting some of them are killed (an rlimit alone would let
    each have its 200); under 1.5 GB all of them allocate, so it is the sum that is capped."""
    limits = dataclasses.replace(FAST, cpu_s=20, wall_s=60.0, processes=16)
    capped = run(FOUR_FORKS, isolation, dataclasses.replace(limits, memory_bytes=512 << 20))
    assert capped.stdout.startswith("killed: ") and str(signal.SIGKILL) in capped.stdout, capped
    roomy = run(FOUR_FORKS, isolation, dataclasses.replace(limits, memory_bytes=1536 << 20))
    assert roomy.stdout.strip() == "all allocated", roomy


def test_huge_file_is_cut_at_the_size_limit(isolation):
    result = run("f = open('big', 'wb')\nwhile True:\n    f.write(b'x' * 65536)", isolation)
    assert not result.ok and "File too large" in result.stderr


@as_root
def test_fork_bomb_is_capped_by_the_process_limit_and_fully_killed(isolation):
    code = (
        "import os, time\nn = 0\ntry:\n    while True:\n        if os.fork() == 0:\n"
        "            time.sleep(60)\n            os._exit(0)\n        n += 1\n"
        "except OSError:\n    print('forks', n, flush=True)\n"
    )
    result = run(code, isolation)  # `run` checks that none of the sleeping children survived
    assert result.ok and 0 < int(result.stdout.split()[1]) < FAST.processes
    start = time.monotonic()
    assert not run("import os\nwhile True:\n    os.fork()", isolation).ok
    assert time.monotonic() - start < FAST.wall_s + 2


@as_root
def test_a_process_that_escapes_with_setsid_is_killed(isolation):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('done')"
    assert run(code, isolation).ok  # `run` asserts the detached child is gone


def test_network_is_unreachable(isolation):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.setblocking(False)
        port = server.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')"
        result = run(code, isolation)
        assert not result.ok and "in" not in result.stdout
        with pytest.raises(BlockingIOError):
            server.accept()  # nothing ever reached the listener


@as_root
def test_files_outside_the_folder_are_unreadable(isolation):
    folder = Path(tempfile.mkdtemp())
    secret = folder / "secret.txt"
    try:
        folder.chmod(0o755)  # reachable, so only the file's own 0600 mode protects it
        secret.write_text("s3cret")
        secret.chmod(0o600)
        result = run(f"print(open({str(secret)!r}).read())", isolation)
        assert not result.ok and "s3cret" not in result.stdout
        assert "Error" in run("import os\nprint(os.listdir('/root'))", isolation).stderr
    finally:
        secret.unlink(missing_ok=True)
        folder.rmdir()


@needs_namespaces
def test_the_host_is_out_of_sight():
    """World-readable host files, other jobs' /tmp files and the host's processes are not there."""
    with tempfile.NamedTemporaryFile("w", dir="/tmp", suffix=".job") as other_job:
        other_job.write("answers")
        other_job.flush()
        os.chmod(other_job.name, 0o644)
        code = (
            "import os\n"
            f"print(os.path.exists('/etc/passwd'), os.path.exists({other_job.name!r}), os.path.exists('/work'))\n"
            "print(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n"
            "print(os.listdir('/'))\n"
        )
        result = run(code, "namespaces")
    assert result.ok, result.stderr
    exists, pids, top = result.stdout.splitlines()
    assert exists == "False False False"
    assert len(json.loads(pids)) <= 3  # the bootstrap's init, the program: nothing of the host's
    assert set(json.loads(top.replace("'", '"'))) <= {"usr", "lib", "lib64", "lib32", "libx32", "proc", "dev", "tmp"}


@needs_namespaces
def test_no_ancestor_is_in_sight():
    """No command line in the sandbox's /proc, its parent's included, shows bwrap, the bootstrap or a host path."""
    code = (
        "import os, json\n"
        "lines = {p: open('/proc/%s/cmdline' % p, 'rb').read().decode('latin-1')\n"
        "         for p in os.listdir('/proc') if p.isdigit()}\n"
        "parent = open('/proc/%d/cmdline' % os.getppid(), 'rb').read().decode('latin-1')\n"
        "print(json.dumps([lines, os.getppid(), parent]))\n"
    )
    result = run(code, "namespaces")
    assert result.ok, result.stderr
    lines, ppid, parent = json.loads(result.stdout)
    assert ppid == 1 and set(lines) <= {"1", "2"}  # the bootstrap's init and the program: nothing above
    seen = "\n".join([*lines.values(), parent])
    python = default_python()
    for leak in ["bwrap", "--unshare", "--ro-bind", "--seccomp", "/dev/fd", "-I", "setrlimit", "def channel",
                 sys.executable, python, os.path.realpath(python), os.path.dirname(python)]:
        assert leak not in seen, leak


@needs_namespaces
def test_what_it_writes_vanishes_and_scratch_space_is_capped():
    token = os.urandom(6).hex()
    code = (
        "import os\n"
        f"for folder in ['.', '/tmp', '/var/tmp', '/dev/shm', '/usr']:\n"
        f"    try:\n        open(os.path.join(folder, 'left-{token}'), 'w').write('x')\n        print('wrote', folder)\n"
        "    except OSError as e:\n        print('refused', folder, e.errno)\n"
        "try:\n    open('/dev/shm/fill', 'wb').write(b'x' * (16 << 20))\nexcept OSError as e:\n    print('shm full', e.errno)\n"
    )
    result = run(code, "namespaces", Limits(wall_s=10.0, file_bytes=64 << 20, scratch_bytes=4 << 20))
    assert "shm full 28" in result.stdout  # ENOSPC at the 4 MiB cap, not 16 MiB of host RAM
    for folder in ["/tmp", "/var/tmp", "/dev/shm"]:
        assert not Path(folder, f"left-{token}").exists()


@needs_namespaces
def test_the_wall_clock_covers_clean_up_of_many_small_files():
    code = "i = 0\nwhile True:\n    open('f%d' % i, 'w').close()\n    i += 1"
    start = time.monotonic()
    result = run(code, "namespaces", Limits(cpu_s=30, wall_s=3.0))
    assert result.timed_out and time.monotonic() - start < 3.0 + 1.5


def test_output_comes_back_as_a_bounded_tail(isolation):
    result = run("print('x' * 100000)\nprint('end')", isolation, Limits(output_bytes=1000))
    assert len(result.stdout) == 1000 and result.stdout.endswith("end\n")


def test_without_a_network_namespace_sockets_are_disabled(monkeypatch):
    no_namespaces = sandbox.BOOTSTRAP.replace("libc.unshare(", "-1 == (")  # as on a locked-down host
    monkeypatch.setattr(sandbox, "BOOTSTRAP", no_namespaces)
    code = (
        "import socket, urllib.request\n"  # urllib imports ssl, which subclasses socket.socket
        "connect = lambda: socket.create_connection(('127.0.0.1', 1))\n"
        "for open_one in (socket.socket, socket.socketpair, connect):\n"
        "    try:\n        open_one()\n        print('open')\n"
        "    except PermissionError:\n        print('blocked')\n"
    )
    result = run(code, "basic")
    assert result.ok, result.stderr
    assert result.stdout.split() == ["blocked"] * 3


def test_a_failed_setup_is_a_sandbox_error_not_a_failed_program(monkeypatch, isolation):
    broken = sandbox.BOOTSTRAP.replace("resource.setrlimit(", "resource.nope(")
    monkeypatch.setattr(sandbox, "BOOTSTRAP", broken)
    with pytest.raises(SandboxError, match="could not be set up.*nope"):
        run_python("print('never runs')", FAST, isolation=isolation)


def test_a_program_cannot_forge_a_setup_failure(isolation):
    code = "import os, sys\nsys.stderr.write('sandbox setup failed: nope\\n')\nsys.stderr.flush()\nos._exit(125)"
    result = run(code, isolation)  # a result of the program's, not a SandboxError
    assert result.returncode == 125 and not result.ok


def test_the_channel_reports_a_program_that_breaks_it(isolation):
    with Sandbox("recv()\nsend({'a': [1, 2.5, 'x\"\\\\\\n\\ud800', None, True]})\nrecv()", FAST,
                 isolation=isolation) as box:
        box.send({"go": 1})
        assert box.recv() == {"a": [1, 2.5, 'x"\\\n\ud800', None, True]}  # the child's own JSON encoder
    small = Limits(wall_s=3.0, message_bytes=100)
    with Sandbox("send('x' * 200)\nrecv()", small, isolation=isolation) as box:
        with pytest.raises(sandbox.SampleError, match="over the 100-byte limit"):
            box.recv()
    with Sandbox("import os\nos._exit(0)", FAST, isolation=isolation) as box:
        with pytest.raises(sandbox.SampleError, match="closed"):
            box.recv()
    with Sandbox("import time\ntime.sleep(30)", Limits(wall_s=1.0), isolation=isolation) as box:
        with pytest.raises(sandbox.SampleTimeout):
            box.recv()


def test_auto_falls_back_to_basic_loudly_where_namespaces_fail(monkeypatch, caplog):
    monkeypatch.setattr(sandbox, "namespaces_available", lambda python: "bwrap: no permission (test)")
    with pytest.raises(SandboxError, match="not available.*no permission"):
        sandbox.resolve_isolation("namespaces", default_python())
    with caplog.at_level("WARNING"):
        assert sandbox.resolve_isolation("auto", default_python()) == "basic"
    assert "SANDBOX FALLBACK" in caplog.text and "apt-get install bubblewrap" in caplog.text


@needs_namespaces
def test_no_user_namespace_of_its_own_so_no_uncapped_tmpfs_and_threads_and_forks_still_work():
    code = (
        "import ctypes, os, threading\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print(libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())\n"  # CLONE_NEWUSER | CLONE_NEWNS
        "t = threading.Thread(target=print, args=('thread',))\nt.start()\nt.join()\n"
        "pid = os.fork()\nif pid == 0:\n    os._exit(7)\nprint('fork', os.waitpid(pid, 0)[1] >> 8)\n"
    )
    result = run(code, "namespaces")
    assert result.stdout.split("\n")[:3] == ["-1 1", "thread", "fork 7"], result.stderr  # EPERM
