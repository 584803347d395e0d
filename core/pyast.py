"""`ast.parse` safe across threads on every CPython this project supports.

CPython before 3.11.8 and 3.12.2 keeps one AST-conversion depth counter per interpreter. A conversion can
let another thread run (a garbage collection inside it may call Python finalizers), and when that thread
converts an AST too, the first one's counter comes back changed and its parse raises
"SystemError: AST constructor recursion depth mismatch" (seen in CI on 3.11.7, in the stage digest). The
counter is set afresh at the start of each conversion, so the error is one race, not a lasting state: this
module parses one source at a time within the process, and parses again when a parse loses such a race to a
thread that did not go through it (a library's own `ast.parse`).
"""

from __future__ import annotations

import ast
import threading

ATTEMPTS = 5
_LOCK = threading.Lock()


def parse(source: str, mode: str = "exec") -> ast.AST:
    """`ast.parse(source, mode=mode)`, one at a time in the process, retried after a lost depth race."""
    for attempt in range(ATTEMPTS):
        with _LOCK:
            try:
                return ast.parse(source, mode=mode)
            except SystemError as exc:
                if "recursion depth mismatch" not in str(exc) or attempt == ATTEMPTS - 1:
                    raise
    raise AssertionError("unreachable")
