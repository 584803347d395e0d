"""One stage of a pipeline spec: its pydantic model, and the stage resolved (settings and plugin configs validated).

`resolve_stage` is where a stage's blocks are validated into values: the pipeline check resolves every stage once
and hands the `ResolvedStage`s on; the digest, the memory estimate and the runners read those.
"""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from alignflow.core.contracts import StageKind, plugin_config_model
from alignflow.core.environments.mcp import McpServer
from alignflow.core.errors import PluginError, SpecError
from alignflow.core.spec.kinds import settings_model

STAGE_REF = "stage:"
POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def loc_text(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def check_pool_name(name: str) -> str:
    """A work pool name that is also a deployment name (`alignflow-stage/NAME`): no `/`, spaces or quotes."""
    if not POOL_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a work pool name: expected letters, digits, '_', '.', '-' "
                         "(starting with a letter or digit)")
    return name


def validate_model(model: type[BaseModel] | None, config: dict, where: str):
    """Validate `config` with `model`; errors read `where.field: message`."""
    if model is None:
        if config:
            raise SpecError(f"{where}: this plugin takes no config, got {', '.join(config)}")
        return None
    try:
        return model.model_validate(config)
    except ValidationError as exc:
        lines = [f"{where}.{loc_text(e['loc'])}: {e['msg']}" for e in exc.errors()]
        raise SpecError("\n".join(lines)) from None


def validate_config(obj: Any, config: dict, where: str):
    """Validate a `config:` block with the plugin's own model; None when the plugin takes none."""
    return validate_model(plugin_config_model(obj), config, where)


def plain_copy(raw: Any) -> Any:
    """A copy of YAML-loaded data (dicts, lists, scalars) that shares no dict or list with `raw` or within itself."""
    if isinstance(raw, dict):
        return {k: plain_copy(v) for k, v in raw.items()}
    if isinstance(raw, list):
        return [plain_copy(v) for v in raw]
    return raw


class PluginRef(BaseModel):
    """A plugin by name, with the config its own `Config` model validates."""

    model_config = ConfigDict(extra="forbid")
    name: str
    config: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def coerce(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value


class RewardRef(PluginRef):
    weight: float = 1.0


class EnvironmentRef(PluginRef):
    """A stage's environment (core/environments): episodes of model turns and its answers, with their limits."""

    max_turns: int = Field(4, ge=1)  # model turns per episode
    max_tokens: int | None = Field(None, ge=1)  # model and environment tokens after the prompt (None: turns x max_new_tokens)
    tool_format: Literal["auto", "hermes", "tag"] = "auto"  # auto: hermes when the chat template knows tool calls
    weight: float = 1.0  # of the episode's reward beside the stage's `rewards`
    mcp: list[McpServer] = Field(default_factory=list)  # MCP servers whose tools every episode gets beside the environment's own


def lookup(where: str, ref: PluginRef, registry):
    """The registered plugin `ref` names; a SpecError at `where.name` when there is none."""
    try:
        return registry.get(ref.name)
    except PluginError as exc:
        raise SpecError(f"{where}.name: {exc}") from None


@dataclass(frozen=True)
class PluginUse:
    """A plugin a stage uses: the registered object `name` names and its `config:` as its `Config` validated it."""

    name: str
    obj: Any  # the registered class (or, for a reward, possibly a function)
    config: Any  # the plugin's `Config` instance; None when it takes none

    def build(self):
        """The plugin to call: the class built with its config (a function reward is itself)."""
        return self.obj(self.config) if inspect.isclass(self.obj) else self.obj


def resolve_plugin(ref: PluginRef, registry, where: str) -> PluginUse:
    """`ref` looked up and its `config:` validated; a SpecError at `where.name` or `where.config.FIELD`."""
    obj = lookup(where, ref, registry)
    return PluginUse(ref.name, obj, validate_model(plugin_config_model(obj), ref.config, f"{where}.config"))


@dataclass(frozen=True)
class ResolvedStage:
    """A stage's blocks as values: its kind's settings model instance and each plugin it uses, in spec order."""

    settings: Any  # the kind's settings model, defaults filled
    algorithm: PluginUse | None = None
    sampler: PluginUse | None = None
    rewards: tuple[PluginUse, ...] = ()
    selectors: tuple[PluginUse, ...] = ()
    environment: PluginUse | None = None


def resolve_stage(stage: "StageSpec", plugins, where: str = "stage", settings: Any = None) -> ResolvedStage:
    """Every block of `stage` validated (`settings`: already validated); the first problem raises a SpecError."""
    def one(ref, registry, field):
        return resolve_plugin(ref, registry, f"{where}, {field}") if ref is not None else None

    return ResolvedStage(
        settings if settings is not None else validate_model(settings_model(stage.kind), stage.settings,
                                                             f"{where}, settings"),
        one(stage.algorithm, plugins.algorithms, "algorithm"), one(stage.sampler, plugins.samplers, "sampler"),
        tuple(one(r, plugins.rewards, f"rewards[{i}]") for i, r in enumerate(stage.rewards)),
        tuple(one(r, plugins.selectors, f"selectors[{i}]") for i, r in enumerate(stage.selectors)),
        one(stage.environment, plugins.environments, "environment"))


class StageSpec(BaseModel):
    """One stage: its kind, inputs (paths, hub ids or `stage:NAME`), plugins and settings."""

    model_config = ConfigDict(extra="forbid")
    kind: StageKind
    inputs: dict[str, str] = Field(default_factory=dict)
    algorithm: PluginRef | None = None
    rewards: list[RewardRef] = Field(default_factory=list)
    sampler: PluginRef | None = None
    selectors: list[PluginRef] = Field(default_factory=list)
    environment: EnvironmentRef | None = None  # multi-turn episodes in place of one completion per sample
    settings: dict[str, Any] = Field(default_factory=dict)
    # The Prefect work pool whose worker runs this stage (flows/launch/pools.py); None: the pipeline's own
    # process. Where a stage runs is not part of its digest: moving it between pools reuses its artifact.
    pool: str | None = None

    @field_validator("pool")
    @classmethod
    def _pool(cls, v):
        return check_pool_name(v) if v is not None else v

    @field_validator("algorithm", "sampler", "environment", mode="before")
    @classmethod
    def _one(cls, v):
        return PluginRef.coerce(v)

    @field_validator("rewards", "selectors", mode="before")
    @classmethod
    def _many(cls, v):
        return [PluginRef.coerce(x) for x in v] if isinstance(v, list) else v

    def references(self) -> dict[str, str]:
        """input name -> upstream stage name, for inputs given as `stage:NAME`."""
        return {k: v[len(STAGE_REF):] for k, v in self.inputs.items() if v.startswith(STAGE_REF)}


HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


def resolve_input(value: str, project: Path) -> Path | str:
    """A local path (relative to the project) when it exists, else a hub id left as a string.

    A hub id has the hub's form, `name` or `org/name`; a value that does not (`./x`, `/x`, `~/x`, a data
    file's suffix, more than one `/`), or whose first folder exists in the project (`models/my-sft`
    when `models/` is there), is a path, and a missing path is an error now rather than a failed
    download later.
    """
    if value.startswith("builtin:"):  # a model the project builds itself (`builtin:tiny`)
        return value
    path = Path(value).expanduser()
    path = path if path.is_absolute() else project / path
    if path.exists():
        return path
    first = Path(value).parts[0] if Path(value).parts else ""
    local = (value.startswith((".", "/", "~")) or Path(value).suffix in {".jsonl", ".json", ".parquet", ".csv"}
             or not HUB_ID.fullmatch(value) or ("/" in value and (project / first).is_dir()))
    if local:
        raise SpecError(f"input {value!r}: no such file or folder (looked in {path})")
    return value
