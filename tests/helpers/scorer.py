"""A real HTTP scorer for the remote rewards' tests: the standard library's ThreadingHTTPServer on 127.0.0.1,
answering each POST by a rule, recording every request and the peak of requests in flight."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

HANG_S = 10.0  # the longest a hanging answer holds its thread: the fixture releases it at once on stop


class Scorer:
    """`rule(scorer, path, body) -> (status, reply)`: reply bytes go out as they are, anything else as JSON."""

    def __init__(self, rule: Callable[["Scorer", str, Any], tuple[int, Any]]):
        self.rule = rule
        self.requests: list[dict] = []  # {"path", "body", "headers", "at": monotonic seconds} in arrival order
        self.attempts: dict[str, int] = {}  # a key the rule chooses -> times asked
        self.inflight = self.peak = 0
        self.lock = threading.Lock()
        self.released = threading.Event()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def count(self, key: str) -> int:
        """How many times `key` was asked, this time included."""
        with self.lock:
            self.attempts[key] = self.attempts.get(key, 0) + 1
            return self.attempts[key]

    def hang(self) -> tuple[int, Any]:
        """Answer only when the server stops (or after HANG_S): a scorer that hangs."""
        self.released.wait(HANG_S)
        return 200, {}

    def __enter__(self) -> "Scorer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def _handler(scorer: Scorer):
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"null")
            with scorer.lock:
                scorer.requests.append({"path": self.path, "body": body, "headers": dict(self.headers),
                                        "at": time.monotonic()})
                scorer.inflight += 1
                scorer.peak = max(scorer.peak, scorer.inflight)
            try:
                status, reply = scorer.rule(scorer, self.path, body)
            finally:
                with scorer.lock:
                    scorer.inflight -= 1
            data = reply if isinstance(reply, bytes) else json.dumps(reply).encode()
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the client gave up (a timeout): nobody to answer

        def log_message(self, *args):  # quiet: the tests read `scorer.requests`
            pass

    return Handler
