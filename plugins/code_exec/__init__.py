"""code_exec reward: run the model's Python against the sample's tests in a sandbox."""

from __future__ import annotations

import logging
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Literal

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rewards import Scores
from alignflow.core.sandbox.runner import Limits, Sandbox, SandboxError
from alignflow.plugins.code_exec.checks import Solution, TestError, run_tests

log = logging.getLogger(__name__)

FENCE = re.compile(r"```(?:python|py)[^\n]*\n(.*?)```", re.DOTALL)
CHILD = (Path(__file__).parent / "harness.py").read_text()
STATES = ("timeout", "crash", "error", "unscored")  # counted per call, logged as reward/<name>/<state>


def extract_code(completion: str) -> str:
    """The last ```python fenced block, else the whole completion."""
    blocks = FENCE.findall(completion)
    return blocks[-1] if blocks else completion


def as_tests(value, column: str) -> list:
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        return [value]  # one test script, or one stdin/stdout case
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TestError(f"column {column!r}: expected a list of tests, a test script or an input/output case, "
                    f"got {type(value).__name__}")


class CodeExec:
    """1 when the completion's Python passes every test (`score: all`), else 0; or the fraction passed.

    Tests (the `tests` column, plus `hidden_tests` when the dataset has one: scored the same, meant to
    be left out of the prompt) are a list of Python snippets, e.g. `assert add(1, 2) == 3` or test
    functions that call the solution, or `{"input": ..., "output": ...}` stdin/stdout cases; a single
    string is one test script. Each sample runs in a fresh sandbox (`alignflow.core.sandbox.runner`) under
    one wall clock; the tests run in this process on values the solution sends back
    (`alignflow.plugins.code_exec.checks`), so the solution never sees an expected value and never reports
    a verdict.

    `score: all` is the default because a fraction pays a policy for hard-coding the answers of the
    tests it can see in the prompt; use `fraction` with hidden tests, or where partial credit is meant.
    A sample the sandbox could not run is None (no opinion), never 0. A sample's code never runs, nor
    is imported, in this process (its results arrive as JSON of builtin data); anything raised while
    handling them, SystemExit included, is that sample's 0. Per call, the counts of samples that timed
    out, crashed (died, broke the channel, or made scoring raise), raised while loading (error) or
    were not scored come back as metrics.
    """

    class Config(PluginConfig):
        # all: 1 when every test passes, else 0; fraction: the share that pass
        score: Literal["all", "fraction"] = "all"
        workers: int = Field(4, ge=1, description="samples run at once")
        cpu_s: int = Field(5, ge=1)  # CPU seconds of one sample (RLIMIT_CPU)
        wall_s: float = Field(10.0, gt=0, description="wall clock of one sample, all its tests and clean-up")
        memory_mb: int = Field(1024, ge=64)  # address space of one sample's processes (RLIMIT_AS), in MiB
        processes: int = Field(32, ge=1, description="process/thread limit of one sample")
        scratch_mb: int = Field(64, ge=1, description="size of the sample's tmpfs (working folder, /tmp; /dev/shm)")
        isolation: Literal["auto", "namespaces", "basic"] = Field(
            "auto", description="namespaces (bubblewrap); basic: rlimits and a fresh uid; auto: namespaces "
                                "where they work, else basic with a warning")
        python: str | None = Field(None, description="interpreter; default: one the sandbox user can read")

    def __init__(self, config: Config | None = None):
        self.config = c = config or self.Config()
        self.limits = Limits(cpu_s=c.cpu_s, wall_s=c.wall_s, memory_bytes=c.memory_mb << 20,
                             processes=c.processes, scratch_bytes=c.scratch_mb << 20)

    def run(self, completion: str, tests: list) -> tuple[float | None, str]:
        """(score, state) of one completion; state is ok, timeout, crash, error or unscored."""
        if not tests:
            return None, "unscored"
        try:
            with Sandbox(CHILD, self.limits, self.config.python, self.config.isolation) as box:
                verdicts, state = run_tests(Solution(box), extract_code(completion), tests)
        except SandboxError as exc:  # our failure, not the sample's: no score rather than a wrong 0
            log.warning("code_exec: %s", exc)
            return None, "unscored"
        except TestError:
            raise  # the dataset's: the error names the test
        except BaseException as exc:  # SystemExit and the like too: one sample never ends the stage
            if isinstance(exc, KeyboardInterrupt) and threading.current_thread() is threading.main_thread():
                raise  # a real Ctrl-C (signals reach only the main thread; workers see raised ones)
            log.warning("code_exec: scoring a sample raised %s: %s; scored 0", type(exc).__name__, exc)
            return 0.0, "crash"
        if self.config.score == "all":
            return float(all(verdicts)), state
        return sum(verdicts) / len(verdicts), state

    def score_one(self, completion: str, tests=None, hidden_tests=None) -> float | None:
        return self.run(completion, as_tests(tests, "tests") + as_tests(hidden_tests, "hidden_tests"))[0]

    def __call__(self, prompts: list[str], completions: list[str], tests: list, hidden_tests=None,
                 **columns) -> Scores:
        hidden = hidden_tests if hidden_tests is not None else [None] * len(completions)
        suites = [as_tests(t, "tests") + as_tests(h, "hidden_tests") for t, h in zip(tests, hidden)]
        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            results = list(pool.map(self.run, completions, suites))
        states = [state for _, state in results]
        return Scores([score for score, _ in results], {s: float(states.count(s)) for s in STATES})


@hookimpl
def register_rewards(register):
    register("code_exec", CodeExec)
