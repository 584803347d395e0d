"""`openai_agent`: episodes driven by an agent program written against the `openai` SDK.

Each episode, the program (a command started per episode, or a Python function) talks to the policy through the
stage's policy endpoint, as it would to any OpenAI-compatible server, and reports the episode's reward. The
trainer trains on the exact ids the endpoint sampled (core/environments/agents.py), never on a re-tokenised
transcript.

A command gets `OPENAI_BASE_URL`, `OPENAI_API_KEY` and `OPENAI_MODEL` (so `openai.OpenAI()` reaches the
policy with no argument), `ALIGNFLOW_SEED`, and the dataset row as JSON in `ALIGNFLOW_ROW` and on its standard
input; it runs in a temporary folder of its own and prints its result as the last line of its output:
`{"reward": 1.0}` (`success` and `ended` are read as a `Step`'s, other keys go to the episode's `info`) or a bare
number. A function is called as `fn(client, row, seed)` with an `openai.OpenAI` client (an `openai.AsyncOpenAI`
one for an `async def`) and returns the reward the same way. A program that exits non-zero, prints no result or
runs past `timeout_s` ends its episode as an error (or timeout); the stage goes on, unless every episode of a
batch ended in error.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import signal
import tempfile
from pathlib import Path

from pydantic import Field, computed_field, model_validator

from alignflow.core import hookimpl
from alignflow.core.environments.agents import AgentConfig, AgentEnvironment, Policy, in_own_thread

OUTPUT_LIMIT = 1 << 20  # bytes of a program's output kept: its last line is its result


class OpenAIAgent(AgentEnvironment):
    """An agent program (a command, or `module:function`) drives each episode through the policy endpoint."""

    class Config(AgentConfig):
        command: list[str] | None = None  # the program, started once per episode (see the module's docstring)
        function: str | None = None  # `package.module:function` or `path/to/file.py:function`, called per episode
        env: dict[str, str] = Field(default_factory=dict)  # more environment variables for the command

        @model_validator(mode="after")
        def _one_program(self):
            if (self.command is None) == (self.function is None):
                raise ValueError("give exactly one of `command` (a program) and `function` (module:function)")
            if self.command is not None and not self.command:
                raise ValueError("`command` is empty: give the program and its arguments")
            if self.function is not None and ":" not in self.function:
                raise ValueError(f"`function` must read `module:function`, got {self.function!r}")
            return self

        @computed_field
        @property
        def sources(self) -> dict[str, str]:
            """The sha256 of each file the program runs (command arguments that are files; the function's module),
            so that an edit to the agent reruns the stages that use it."""
            paths = [a for a in self.command or [] if Path(a).is_file()]
            if self.function is not None:
                where = self.function.rpartition(":")[0]
                spec = None if where.endswith(".py") else importlib.util.find_spec(where)
                origin = where if spec is None else spec.origin
                paths += [origin] if origin and Path(origin).is_file() else []
            return {p: hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}

    async def rollout(self, row: dict, seed: int, policy: Policy):
        if self.config.function is not None:
            return await self._function(row, seed, policy)
        return await self._command(row, seed, policy)

    async def _function(self, row: dict, seed: int, policy: Policy):
        fn = load_function(self.config.function)
        if inspect.iscoroutinefunction(fn):
            async with policy.client() as client:
                return result_of(await fn(client, row, seed), self.config.function)
        def run():
            with policy.sync_client() as client:
                return fn(client, row, seed)

        # a thread of its own per episode: asyncio's default pool has a handful, and an episode mostly waits
        return result_of(await in_own_thread(run), self.config.function)

    async def _command(self, row: dict, seed: int, policy: Policy):
        text = json.dumps(row, ensure_ascii=False, default=str)
        # the program runs in a folder of its own: its files named relative to the stage's folder, made absolute
        command = [str(Path(a).absolute()) if Path(a).is_file() else a for a in self.config.command]
        env = {**os.environ, **self.config.env, **policy.environ(), "ALIGNFLOW_ROW": text, "ALIGNFLOW_SEED": str(seed)}
        with tempfile.TemporaryDirectory(prefix="alignflow-agent-") as cwd:
            proc = await asyncio.create_subprocess_exec(
                *command, cwd=cwd, env=env, stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
                limit=OUTPUT_LIMIT)
            try:
                out, err = await proc.communicate(text.encode())
            finally:
                if proc.returncode is None:  # timed out or the stage is stopping: the program and its children go
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    await proc.wait()
        name = " ".join(self.config.command)
        if proc.returncode != 0:
            tail = err.decode(errors="replace").strip()[-2000:]
            raise RuntimeError(f"agent program `{name}` exited with {proc.returncode}: {tail}")
        lines = out.decode(errors="replace").strip().splitlines()
        if not lines:
            raise RuntimeError(f"agent program `{name}` printed no result (its last line: a number or "
                               '{"reward": ...})')
        try:
            value = json.loads(lines[-1])
        except json.JSONDecodeError:
            raise RuntimeError(f"agent program `{name}`: its last line is not a number or a JSON object: "
                               f"{lines[-1][:200]!r}") from None
        return result_of(value, name)


def load_function(where: str):
    """The function `module:name` or `path/to/file.py:name` names (a file is loaded once per process)."""
    module, _, name = where.rpartition(":")
    if module.endswith(".py"):
        path = Path(module).absolute()
        key = "alignflow_agent_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
        if key not in _files:
            spec = importlib.util.spec_from_file_location(key, path)
            if spec is None or not path.is_file():
                raise RuntimeError(f"agent function {where!r}: no Python file {path}")
            _files[key] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(_files[key])
        found = _files[key]
    else:
        found = importlib.import_module(module)
    if not callable(getattr(found, name, None)):
        raise RuntimeError(f"agent function {where!r}: {module} has no function {name!r}")
    return getattr(found, name)


_files: dict = {}  # agent files loaded, by path


def result_of(value, who: str):
    """An agent's result as the environment's reward: a number, or an object with a numeric `reward`."""
    if isinstance(value, bool) or not isinstance(value, (int, float, dict)):
        raise RuntimeError(f"agent {who!r} returned {value!r}: expected a number or {{\"reward\": ...}}")
    if isinstance(value, dict) and (isinstance(value.get("reward"), bool)
                                    or not isinstance(value.get("reward"), (int, float))):
        raise RuntimeError(f"agent {who!r} returned {value!r}: its `reward` must be a number")
    return value


@hookimpl
def register_environments(register):
    register("openai_agent", OpenAIAgent)
