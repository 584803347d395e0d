"""code_exec reward: run the model's Python against the sample's tests in a sandbox."""

from __future__ import annotations

import logging
import re
import secrets
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.sandbox import Limits, SandboxError, run_python

log = logging.getLogger(__name__)

FENCE = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.DOTALL)

# Runs the solution, then each test in its namespace. A test that passes prints a per-run random
# marker, so `exit(0)` or printing fake results does not pass; test output is discarded so the
# markers stay in the captured tail of stdout.
HARNESS = """
import os as _os, sys as _sys
def _alignflow_run(solution, tests, marker):
    ns = {"__name__": "__main__"}
    exec(compile(solution, "solution.py", "exec"), ns)
    _sys.stdout = open(_os.devnull, "w")
    for i, test in enumerate(tests):
        try:
            exec(compile(test, f"test_{i}.py", "exec"), ns)
        except BaseException:
            continue
        _os.write(1, f"\\n{marker} {i}\\n".encode())
"""


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else the whole completion."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


class CodeExec:
    """Fraction of tests passed (or 1/0 with score='all') by the completion's Python, run in a sandbox.

    `tests` column: a list of test snippets (e.g. assert statements), each run separately,
    or one test script string (scored as a single test). Tests passed before a crash or a
    timeout still count.
    """

    class Config(PluginConfig):
        score: Literal["fraction", "all"] = "fraction"
        workers: int = Field(4, ge=1, description="samples run at once")
        cpu_s: int = Field(5, ge=1)
        wall_s: float = Field(10.0, gt=0)
        memory_mb: int = Field(1024, ge=64)
        processes: int = Field(32, ge=1, description="process/thread limit of one sample")
        python: str | None = Field(None, description="interpreter; default: one the sandbox user can read")

    def __init__(self, config: Config | None = None):
        self.config = c = config or self.Config()
        self.limits = Limits(cpu_s=c.cpu_s, wall_s=c.wall_s, memory_bytes=c.memory_mb << 20,
                             processes=c.processes)

    def score_one(self, completion: str, tests: list[str] | str | None) -> float | None:
        """Run one completion against its tests; None when the sample has no tests."""
        tests = [tests] if isinstance(tests, str) else list(tests or [])
        if not tests:
            return None
        marker = secrets.token_hex(16)
        program = f"{HARNESS}\n_alignflow_run({extract_code(completion)!r}, {tests!r}, {marker!r})\n"
        try:
            result = run_python(program, self.limits, self.config.python)
        except SandboxError as exc:  # our failure, not the sample's: no score rather than a wrong 0
            log.warning("code_exec: %s", exc)
            return None
        passed = len(set(re.findall(rf"^{marker} (\d+)$", result.stdout, re.MULTILINE)))
        if self.config.score == "all":
            return float(passed == len(tests))
        return passed / len(tests)

    def __call__(self, prompts: list[str], completions: list[str], tests: list, **columns) -> list:
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            return list(pool.map(self.score_one, completions, tests))


@hookimpl
def register_rewards(register):
    register("code_exec", CodeExec)
