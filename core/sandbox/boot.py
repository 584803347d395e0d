"""The sandbox's bootstrap: the first code of every sandboxed interpreter, before any untrusted code.

Not imported: `alignflow.core.sandbox.runner` runs it as `python -I -S /dev/fd/N` from a pipe (its text
is in no command line), with the two channel fds as arguments. As pid 1 of a fresh pid namespace it
blanks its command line and forks: the parent stays the run's init (reaps, exits with the program's
status), the child reads its configuration from the channel (marshal: written only by the trusted
parent), sets sys.path, the rlimits, the uid and the network, says it is ready, then runs the
program with `send` and `recv` in its globals. Python 3.8+: it runs on the system's interpreter.
"""
import marshal, os, resource, sys
def channel(rfd, wfd, write=os.write, read=os.read, loads=marshal.loads, frm=int.from_bytes):
    esc = {i: "\\u%04x" % i for i in list(range(32)) + list(range(0xD800, 0xE000))}
    esc.update({34: '\\"', 92: "\\\\"})
    floats = {"inf": "Infinity", "-inf": "-Infinity", "nan": "NaN"}
    def dumps(x):  # JSON of plain data, without the json module (which costs its importer 14 ms)
        t = type(x)
        if x is None or t is bool:
            return "null" if x is None else "true" if x else "false"
        if t is int:
            return int.__repr__(x)
        if t is float:
            r = float.__repr__(x)
            return floats.get(r, r)
        if t is str:
            return '"' + str.translate(x, esc) + '"'
        if t is list or t is tuple:
            return "[" + ",".join([dumps(v) for v in x]) + "]"
        if t is dict:
            return "{" + ",".join([dumps(str(k)) + ":" + dumps(v) for k, v in x.items()]) + "}"
        raise TypeError("cannot send a %s" % t.__name__)
    def send(obj):
        data = dumps(obj).encode()
        data = len(data).to_bytes(4, "big") + data
        while data:
            data = data[write(wfd, data):]
    def exact(n):
        parts = []
        while n:
            part = read(rfd, min(n, 1 << 20))
            if not part:
                raise EOFError("the channel closed")
            parts.append(part)
            n -= len(part)
        return b"".join(parts)
    def recv():  # from the trusted side only: marshal
        return loads(exact(frm(exact(4), "big")))
    return send, recv
def setup(cfg):
    for name, (soft, hard) in cfg["rlimits"].items():
        resource.setrlimit(getattr(resource, name), (soft, hard))
    offline = cfg["offline"]
    if not offline:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        CLONE_NEWNET, CLONE_NEWUSER = 0x40000000, 0x10000000
        offline = libc.unshare(CLONE_NEWNET) == 0  # needs CAP_SYS_ADMIN: root on most hosts
    if cfg["uid"] is not None:
        os.setgroups([])
        os.setgid(cfg["uid"])
        os.setuid(cfg["uid"])
        if 0 in os.getresuid() or 0 in os.getresgid():
            raise PermissionError("still root after setuid")
    if not offline:  # an unprivileged user namespace owns its own network namespace
        offline = libc.unshare(CLONE_NEWUSER | CLONE_NEWNET) == 0
    if not offline:
        import socket, _socket
        class _NoSocket(socket.socket):  # a class, so that modules subclassing socket still import
            def __init__(self, *args, **kwargs):
                raise PermissionError("network access is disabled in the sandbox")
        for mod in (socket, _socket):
            mod.socket = mod.SocketType = _NoSocket
def blank_cmdline():
    """Zero this process's argv in memory, so that /proc/<pid>/cmdline shows nothing of how it started."""
    fields = open("/proc/self/stat", "rb").read().rsplit(b")", 1)[1].split()
    start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48 and 49 of stat
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        mem.seek(start)
        mem.write(bytes(end - start))
def init(child, fds):
    """pid 1: reap every orphan until the program's process ends, then end with its status (and so the run)."""
    for fd in fds:
        os.close(fd)  # the channel closes when the program's side of it does
    while True:
        pid, status = os.wait()
        if pid == child:
            os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))
try:
    fds = int(sys.argv[1]), int(sys.argv[2])
    if os.getpid() == 1:  # namespaces: no ancestor is in sight, and init is trusted code, not the program
        blank_cmdline()
        child = os.fork()
        if child:
            init(child, fds)
    send, recv = channel(*fds)
    cfg = recv()
    sys.path[:] = cfg["path"]  # started with -S: site's .pth scan is slow; this is the path it makes
    setup(cfg)
except BaseException as exc:
    sys.stderr.write("sandbox setup failed: %r\n" % (exc,))
    os._exit(125)
del setup, channel, blank_cmdline, init
send({"ready": True})
sys.argv = ["main.py"]
exec(compile(cfg["program"], "<sandbox>", "exec"), {"__name__": "__sandbox__", "send": send, "recv": recv})
