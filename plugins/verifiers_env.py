"""`verifiers`: episodes of a verifiers environment (https://github.com/PrimeIntellect-ai/verifiers, 0.4's v1
stack: `Env`, `Taskset`, `Harness`, rewards and judges), its model calls sent to the policy endpoint.

Each episode, the stage's dataset row becomes one task of the environment's taskset (its task data from the row's
columns, see `task_of`), and verifiers runs the episode as it does in `vf-eval`: its harness calls the model
through verifiers' interception server, which relays every call to the episode's policy URL; then the task's
rewards score the trace. Their weighted sum is the episode's reward, each one and the task's metrics go to its
`info`. A failed verifiers episode (a harness, a reward or a model call that failed) ends as an error.
The trainer trains on the ids the endpoint drew (core/environments/agents.py), never on verifiers' record.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import re
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import Field, computed_field, model_validator

from alignflow.core import AlignflowError, hookimpl
from alignflow.core.environments.agents import AgentConfig, AgentEnvironment, Policy
from alignflow.core.fingerprint import distribution_version

KEY_VAR = "VERIFIERS_POLICY_KEY"  # verifiers reads the model's API key from a variable; unset, it sends "EMPTY"
_LOADED: dict[str, Any] = {}  # the loaded environments of this process, by `Config.key`
_LOADING = threading.Lock()
_SERVED: dict[tuple[str, int], "_Served"] = {}  # (config key, event loop): what serves that loop's episodes


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as exc:
        raise AlignflowError("environment 'verifiers' needs the verifiers library (0.4): "
                             "pip install 'alignflow[verifiers]'") from exc
    return vf


class VerifiersEnv(AgentEnvironment):
    """A verifiers environment (an installed one by `id`, or `module:function`) plays each episode."""

    libraries = ("verifiers",)  # its version enters the digest of a stage that uses this environment

    class Config(AgentConfig):
        id: str | None = None  # an installed verifiers environment: its taskset id, as `vf-eval ID` takes it
        loader: str | None = None  # `package.module:function` returning a `verifiers.v1.Env`, called with `args`
        # with `id`: verifiers' env config (`taskset`, `agent`, env `id`, ...), over {taskset: {id}}; with `loader`:
        # the function's keyword arguments
        args: dict[str, Any] = Field(default_factory=dict)
        # task data field -> the row's column, over the defaults: each field from the column of its name (`prompt`
        # from `question` when the row has no `prompt`)
        columns: dict[str, str] = Field(default_factory=dict)
        # verifiers' sampling settings for each model call; the endpoint samples as the stage's `generation` says
        # and honours only `max_tokens` (below the stage's `max_new_tokens`)
        sampling: dict[str, Any] = Field(default_factory=dict)

        @model_validator(mode="after")
        def _one_source(self):
            if (self.id is None) == (self.loader is None):
                raise ValueError("give exactly one of `id` (an installed verifiers environment) and `loader` "
                                 "(module:function returning one)")
            if self.loader is not None and ":" not in self.loader:
                raise ValueError(f"`loader` must read `module:function`, got {self.loader!r}")
            refused = [k for k in ("stop", "top_logprobs") if self.sampling.get(k)]
            refused += ["n"] if self.sampling.get("n", 1) != 1 else []
            if refused:
                raise ValueError(f"`sampling` sets {refused}, which the policy endpoint refuses (it samples one "
                                 "completion, ending at the policy's end-of-turn token)")
            return self

        @computed_field
        @property
        def packages(self) -> dict[str, str | None]:
            """The version of each installed package the config names by `id` (the environment's own, a paired env,
            harness or judge in `args`; verifiers' built-in ones go with its version), so that upgrading one reruns
            the stages that use it."""
            names = _ids(self.model_dump(include={"id", "args"}))
            return {_canonical(dist): distribution_version(dist) for name in names
                    if not _builtin(_module_of(name)) for dist in _distributions().get(_module_of(name), [])}

        @computed_field
        @property
        def sources(self) -> dict[str, str]:
            """The sha256 of the loader's module, so that an edit to the environment it builds reruns its stages."""
            if self.loader is None:
                return {}
            spec = importlib.util.find_spec(self.loader.split(":")[0])
            path = spec.origin if spec is not None and spec.origin and Path(spec.origin).is_file() else None
            return {path: hashlib.sha256(Path(path).read_bytes()).hexdigest()} if path else {}

        @property
        def key(self) -> str:
            """What identifies the loaded environment: the loader or id and its arguments."""
            return json.dumps([self.id, self.loader, self.args], sort_keys=True, default=str)

    async def rollout(self, row: dict, seed: int, policy: Policy):
        vf = _verifiers()
        env = await asyncio.to_thread(environment, self.config)  # the first load takes seconds: not on the loop
        task = task_of(env, row, self.config.columns)
        ctx = vf.ModelContext(model=policy.model,
                              client=vf.EvalClientConfig(base_url=policy.base_url, api_key_var=KEY_VAR),
                              sampling=vf.SamplingConfig.model_validate(self.config.sampling))
        served = await _Served.acquire(self.config.key, env)
        try:
            # one attempt: a retried episode would leave its failed attempt's calls in the episode's samples
            episode = await served.env.run_episode(task, ctx)
        finally:
            await served.release()
        return outcome(episode, self.config.id or self.config.loader)


def environment(config: VerifiersEnv.Config):
    """The verifiers `Env` for `config`, loaded once per process (verifiers' own loader for an `id`)."""
    with _LOADING:
        if config.key not in _LOADED:
            vf = _verifiers()
            if config.loader is not None:
                module, _, name = config.loader.partition(":")
                env = getattr(importlib.import_module(module), name)(**config.args)
                if not isinstance(env, vf.Env):
                    raise AlignflowError(f"environment 'verifiers': loader {config.loader!r} returned "
                                         f"{type(env).__name__}, expected a verifiers.v1.Env")
            else:
                args = copy.deepcopy(config.args)
                args["taskset"] = {**args.get("taskset", {}), "id": config.id}
                env = vf.load_environment(vf.resolve_env_config(args))
            _LOADED[config.key] = env
        return _LOADED[config.key]


def task_of(env, row: dict, columns: dict[str, str]):
    """The taskset's task for dataset row `row`: each field of its task data from the row's column of that name
    (or the one `columns` maps it to); a dict `info` column (verifiers' dataset convention for per-row extras)
    fills the fields the columns did not."""
    task_cls = type(env.taskset).task_type()
    data_cls = task_cls.data_type()
    unknown = sorted(set(columns) - set(data_cls.model_fields))
    if unknown:
        raise AlignflowError(f"environment 'verifiers': `columns` maps {unknown}, which {data_cls.__name__} (the "
                             f"task data of {type(env.taskset).__name__}) does not have; its fields: "
                             f"{sorted(data_cls.model_fields)}")
    mapping = {name: name for name in data_cls.model_fields if name != "idx"}
    if "prompt" not in row and "question" in row:
        mapping["prompt"] = "question"
    mapping.update(columns)
    missing = sorted(column for column in columns.values() if column not in row)
    if missing:
        raise AlignflowError(f"environment 'verifiers': row {_row_text(row)} has no column {missing} (`columns` "
                             f"reads it); its columns: {sorted(row)}")
    values = {name: row[column] for name, column in mapping.items() if column in row}
    info = row.get("info")
    if isinstance(info, dict) and "info" not in data_cls.model_fields:
        values = {**{k: v for k, v in info.items() if k in data_cls.model_fields}, **values}
    try:
        data = data_cls.model_validate(values)
    except ValueError as exc:
        raise AlignflowError(f"environment 'verifiers': row {_row_text(row)} does not make a "
                             f"{data_cls.__name__}: {exc}") from exc
    task = task_cls(data, env.taskset.config.task)
    if env.taskset.system_prompt is not None and data.system_prompt is None:  # as iterating the taskset does
        task = task.with_system_prompt(env.taskset.system_prompt)
    return task


def outcome(episode, name: str) -> dict:
    """A finished verifiers episode as the episode's result: the reward, and the rewards and metrics in `info`.
    Several traces (an env with several agents): the mean over the trainable ones."""
    if not episode.ok:
        error = episode.last_error or next((t.last_error for t in episode.traces if t.last_error), None)
        what = f"{error.type}: {error.message}" if error is not None else "it did not complete"
        raise RuntimeError(f"verifiers environment {name!r}: the episode failed: {what}")
    traces = [t for t in episode.traces if t.agent is None or t.agent.trainable] or episode.traces
    info: dict[str, list[float]] = {}
    for trace in traces:
        for key, value in [*((f"reward/{k}", None if r is None else r.score) for k, r in trace.rewards.items()),
                           *trace.metrics.items(), ("turns", trace.num_turns)]:
            if value is not None:
                info.setdefault(key, []).append(float(value))
    return {"reward": sum(t.reward for t in traces) / len(traces),
            **{k: sum(v) / len(v) for k, v in info.items()}}


class _Served:
    """One event loop's hold on an environment's serving resources (verifiers' interception server, shared tool
    servers): entered by a task of its own when the loop's first episode starts, left when its last one ends."""

    def __init__(self, key: str, env):
        self.key = key
        self.env = copy.copy(env)  # `serving()` keeps its servers on the instance: a copy per event loop
        self.users = 0
        self.loop = asyncio.get_running_loop()
        self.ready = self.loop.create_future()
        self.done = asyncio.Event()
        self.task = asyncio.create_task(self._hold())

    @classmethod
    async def acquire(cls, key: str, env) -> "_Served":
        loop = asyncio.get_running_loop()
        served = _SERVED.get((key, id(loop)))
        if served is None or served.loop is not loop:
            served = _SERVED[key, id(loop)] = cls(key, env)
        served.users += 1
        try:
            await asyncio.shield(served.ready)
        except BaseException:
            await served.release()
            raise
        return served

    async def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            if _SERVED.get((self.key, id(self.loop))) is self:
                del _SERVED[self.key, id(self.loop)]
            self.done.set()
            await asyncio.gather(self.task, return_exceptions=True)

    async def _hold(self) -> None:
        try:
            async with self.env.serving():
                self.ready.set_result(None)
                await self.done.wait()
        except BaseException as exc:
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise


def _ids(value) -> list[str]:
    """Every string under an `id` key of a nested config."""
    if isinstance(value, dict):
        own = [value["id"]] if isinstance(value.get("id"), str) else []
        return own + [i for k, v in value.items() if k != "id" for i in _ids(v)]
    if isinstance(value, list):
        return [i for v in value for i in _ids(v)]
    return []


def _builtin(module: str) -> bool:
    """Whether verifiers ships a plugin of that module name (its loaders try theirs first), found without importing
    verifiers.v1, which takes seconds."""
    spec = importlib.util.find_spec("verifiers")
    root = Path(spec.origin).parent / "v1" if spec is not None and spec.origin else None
    return root is not None and any((root / group / module).is_dir() or (root / group / f"{module}.py").is_file()
                                    for group in ("tasksets", "envs", "harnesses", "judges"))


def _module_of(plugin_id: str) -> str:
    """The module a verifiers plugin id imports (hub ids `owner/name@version` install as `name`)."""
    return plugin_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower().partition(".")[0]


def _canonical(distribution: str) -> str:
    return re.sub(r"[-_.]+", "-", distribution).lower()  # PEP 503: `reasoning_gym` is `reasoning-gym`


@lru_cache(maxsize=1)
def _distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def _row_text(row: dict) -> str:
    text = repr(row.get("prompt", row.get("question", row)))
    return text if len(text) <= 80 else text[:77] + "..."


@hookimpl
def register_environments(register):
    register("verifiers", VerifiersEnv)
