"""Pipeline specs: pydantic models for the YAML, plugin-aware validation, and the stage DAG."""

from __future__ import annotations

import graphlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from alignflow.core.spec import rounds
from alignflow.core.contracts import StageKind
from alignflow.core.errors import SpecError
from alignflow.core.spec.kinds import settings_model, stage_kind
from alignflow.core.spec.rounds import LoopSpec, RoundOf
from alignflow.core.spec.settings import TrainSettings
# the stage model and its checks live in core/spec/stage.py; these names are imported from here too
from alignflow.core.spec.stage import (STAGE_REF, PluginRef, ResolvedStage, RewardRef, StageSpec,  # noqa: F401
                                       check_pool_name, loc_text, lookup, resolve_input, resolve_plugin,
                                       validate_config, validate_model)

DEFAULT_SAMPLER = "hf"  # stages that generate use it unless the spec names another


class PipelineSpec(BaseModel):
    """A pipeline; `stages` is the flat DAG, with each loop (core/spec/rounds.py) unrolled into its rounds."""

    model_config = ConfigDict(extra="forbid")
    name: str
    description: str = ""
    seed: int = 0
    stages: dict[str, StageSpec]
    pools: dict[StageKind, str] = Field(default_factory=dict)  # stage kind -> work pool, where `pool` is unset
    _loops: dict[str, LoopSpec] = PrivateAttr(default_factory=dict)
    _rounds: dict[str, RoundOf] = PrivateAttr(default_factory=dict)  # unrolled stage -> its loop and round
    _written: dict[str, StageSpec] | None = PrivateAttr(default=None)

    @field_validator("pools")
    @classmethod
    def _pools(cls, v):
        return {kind: check_pool_name(pool) for kind, pool in v.items()}

    def pool_of(self, name: str) -> str | None:
        """The work pool stage `name` runs on: its own `pool`, else `pools` by its kind, else None (here)."""
        stage = self.stages[name]
        return stage.pool if stage.pool is not None else self.pools.get(stage.kind)

    def order(self) -> list[str]:
        """Stage names in dependency order (each after every stage it reads from)."""
        graph = {name: set(stage.references().values()) for name, stage in self.stages.items()}
        return list(graphlib.TopologicalSorter(graph).static_order())

    @property
    def loops(self) -> dict[str, LoopSpec]:
        return self._loops

    def round_of(self, name: str) -> RoundOf | None:
        """The loop, loop stage and round a stage was unrolled from; None outside loops."""
        return self._rounds.get(name)

    def label(self, name: str) -> str:
        """How the spec file names a stage: `LOOP.X` for every round of loop stage X."""
        of = self._rounds.get(name)
        return of.label if of else name

    def written(self) -> dict[str, StageSpec]:
        """Each stage once, as written: a loop stage under its label, not once per round."""
        return self.stages if self._written is None else self._written


def read_yaml(path: Path):
    """A pipeline file's YAML; a SpecError names the file, and the line and column of a syntax error."""
    try:
        return yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError:
        raise SpecError(f"{path}: no such pipeline file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise SpecError(f"{where}: not valid YAML: {problem}") from None


def load_spec(path: str | Path, plugins=None) -> PipelineSpec:
    """Read, validate and check a pipeline YAML; every error names the file, stage and field."""
    return parse_spec(read_yaml(Path(path)), str(path), plugins)


def parse_spec(raw: Any, source: str = "<spec>", plugins=None) -> PipelineSpec:
    """The validated spec, or one SpecError listing every stage's problems."""
    spec, problems = parse_shape(raw, source)
    problems += resolve_stages(spec, source, plugins, skip=stages_of(problems))[1]
    raise_problems(source, problems)
    return spec


def resolved_stages(spec: PipelineSpec, plugins, source: str = "<spec>") -> dict[str, ResolvedStage]:
    """Every stage of a parsed spec resolved (core/spec/stage.py), or one SpecError listing the problems."""
    stages, problems = resolve_stages(spec, source, plugins)
    raise_problems(source, problems)
    return stages


def parse_shape(raw: Any, source: str = "<spec>") -> tuple[PipelineSpec, list[str]]:
    """The spec and each stage's first problem of shape (inputs, which plugins, settings), without
    loading any plugin: the checks `alignflow validate` reports before importing plugin code (and torch).
    A spec that is not a pipeline at all (bad YAML structure, a missing stage, a cycle) raises."""
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping with 'name' and 'stages', got {type(raw).__name__}")
    plain, loop_blocks, order = rounds.split_loops(raw)
    loops, errors = rounds.validate_loops(loop_blocks)
    try:
        spec = PipelineSpec.model_validate(plain)
    except ValidationError as exc:
        errors = [(loc_text(e["loc"]), e["msg"]) for e in exc.errors()] + errors
    if len(errors) == 1:
        raise SpecError(f"{source}: {errors[0][0]}: {errors[0][1]}")
    if errors:
        raise SpecError(f"{source}: invalid pipeline spec\n" + "\n".join(f"  {at}: {msg}" for at, msg in errors))
    if not spec.stages and not loops:
        raise SpecError(f"{source}: 'stages' is empty; a pipeline needs at least one stage")
    written = {}  # each stage once, in the file's order; a loop's under `LOOP.X`
    for name in order:
        written.update({f"{name}.{x}": s for x, s in loops[name].stages.items()} if name in loops
                       else {name: spec.stages[name]})
    problems = []
    for name, stage in written.items():  # before unrolling: each round copies its stage, defaults filled here
        try:
            check_shape(name, stage, source)
        except SpecError as exc:
            problems.append(str(exc))
    if loops:
        spec.stages, spec._rounds = rounds.unroll(spec.stages, loops, order, source)
        spec._loops, spec._written = loops, written
    check_graph(spec, source)
    return spec, problems


def resolve_stages(spec: PipelineSpec, source: str, plugins=None,
                   skip: set[str] = frozenset()) -> tuple[dict[str, ResolvedStage], list[str]]:
    """({stage: resolved} for each stage without a problem, a loop's rounds sharing their loop stage's, and every
    problem with the stages' plugins: unknown names, misplaced algorithms, bad configs)."""
    if plugins is None:
        from alignflow.core.plugins import get_plugins

        plugins = get_plugins()
    written, problems = {}, []
    for name, stage in spec.written().items():
        if name not in skip:  # its shape is wrong already: its plugins are not looked at
            written[name], found = check_plugins(name, stage, source, plugins)
            problems += found
    return {name: written[spec.label(name)] for name in spec.stages if written.get(spec.label(name))}, problems


def stages_of(problems: list[str]) -> set[str]:
    """The stage names the problems (`...: stage 'x', ...`) are about."""
    return {p.split("stage '", 1)[1].split("'", 1)[0] for p in problems if "stage '" in p}


def raise_problems(source: str, problems: list[str]) -> None:
    if len(problems) == 1:
        raise SpecError(problems[0])
    if problems:
        raise SpecError(f"{source}: {len(problems)} problems:\n" + "\n".join(f"  {p}" for p in problems))


def check_graph(spec: PipelineSpec, source: str) -> None:
    for name, stage in spec.stages.items():
        for field, upstream in stage.references().items():
            if upstream not in spec.stages:
                raise SpecError(
                    f"{source}: stage {name!r}, inputs.{field}: refers to stage {upstream!r}, which "
                    f"does not exist (stages: {', '.join(spec.stages)})"
                )
    try:
        spec.order()
    except graphlib.CycleError as exc:
        cycle = " -> ".join(exc.args[1][::-1])
        raise SpecError(f"{source}: the stages form a cycle: {cycle}") from None


def check_shape(name: str, stage: StageSpec, source: str) -> None:
    """What the stage kind allows: inputs, which plugins it takes, its settings (no plugin code loaded)."""
    where = f"{source}: stage {name!r}"
    kind = stage_kind(stage.kind)
    for field in stage.inputs:
        if field not in kind.inputs:
            raise SpecError(f"{where}, inputs.{field}: not an input of a {stage.kind!r} stage "
                            f"(allowed: {', '.join(sorted(kind.inputs))})")
    for field in sorted(kind.required - set(stage.inputs)):
        raise SpecError(f"{where}, inputs.{field}: required by a {stage.kind!r} stage")
    given = {"algorithm": stage.algorithm is not None, "rewards": bool(stage.rewards),
             "sampler": stage.sampler is not None, "selectors": bool(stage.selectors),
             "environment": stage.environment is not None}
    for field, present in given.items():
        if present and field not in kind.plugins:
            raise SpecError(f"{where}, {field}: a {stage.kind!r} stage takes no {field}")
    if "algorithm" in kind.plugins and stage.algorithm is None:
        raise SpecError(f"{where}, algorithm: required by a {stage.kind!r} stage")
    if kind.needs_rewards and not stage.rewards and stage.environment is None:
        raise SpecError(f"{where}, rewards: a {stage.kind!r} stage needs at least one reward (or an environment)")
    if stage.sampler is None and (stage.rewards or stage.environment or kind.samples) and "sampler" in kind.plugins:
        stage.sampler = PluginRef(name=DEFAULT_SAMPLER)
    _check_settings(where, stage)


def check_plugins(name: str, stage: StageSpec, source: str, plugins) -> tuple[ResolvedStage | None, list[str]]:
    """(the stage resolved, or None; its plugins' problems: unknown, serving another kind, a bad config)."""
    where = f"{source}: stage {name!r}"
    problems = []

    def use(field: str, ref: PluginRef | None, registry, more=None):
        try:
            found = resolve_plugin(ref, registry, f"{where}, {field}") if ref is not None else None
            if more is not None and found is not None:
                more(found.obj)
            return found
        except SpecError as exc:
            problems.append(str(exc))

    algorithm = None
    if stage.algorithm is not None:  # the kind first: an rl config in a preference stage is misplaced, not bad
        try:
            algo = lookup(f"{where}, algorithm", stage.algorithm, plugins.algorithms)
            if getattr(algo, "stage", None) != stage.kind:
                raise SpecError(f"{where}, algorithm: {stage.algorithm.name!r} serves "
                                f"{getattr(algo, 'stage', '?')!r} stages, not {stage.kind!r}")
        except SpecError as exc:
            problems.append(str(exc))
        else:
            algorithm = use("algorithm", stage.algorithm, plugins.algorithms, lambda a: _check_teacher(where, stage, a))
    sampler = use("sampler", stage.sampler, plugins.samplers)
    rewards = tuple(use(f"rewards[{i}]", ref, plugins.rewards) for i, ref in enumerate(stage.rewards))
    selectors = tuple(use(f"selectors[{i}]", ref, plugins.selectors) for i, ref in enumerate(stage.selectors))
    environment = use("environment", stage.environment, plugins.environments, lambda e: _check_mcp(where, stage, e))
    if problems:
        return None, problems
    settings = validate_model(settings_model(stage.kind), stage.settings, f"{where}, settings")  # its shape passed
    return ResolvedStage(settings, algorithm, sampler, rewards, selectors, environment), []


def _check_mcp(where: str, stage: StageSpec, env) -> None:
    """An `mcp` list serves environments played turn by turn; an agent environment runs its own tool calls."""
    if not stage.environment.mcp:
        return
    from alignflow.core.environments.agents import AgentEnvironment

    if isinstance(env, type) and issubclass(env, AgentEnvironment):
        raise SpecError(f"{where}, environment.mcp: {stage.environment.name!r} drives its own episodes through "
                        "the policy endpoint and calls its tools itself; MCP servers serve environments whose "
                        "turns the default step answers")


def _check_teacher(where: str, stage: StageSpec, algo) -> None:
    """A `teacher` input exactly when the algorithm learns from one (`requires_teacher`): a teacher that
    nothing reads would still change the stage's digest."""
    wants, given = getattr(algo, "requires_teacher", False), "teacher" in stage.inputs
    if wants and not given:
        raise SpecError(f"{where}, inputs.teacher: algorithm {stage.algorithm.name!r} learns from a teacher; "
                        "give its model path or `stage:NAME`")
    if given and not wants:
        raise SpecError(f"{where}, inputs.teacher: algorithm {stage.algorithm.name!r} uses no teacher")


def _check_settings(where: str, stage: StageSpec) -> None:
    """The kind's settings model, then what a pipeline cannot mean: lr 0, batches that do not divide."""
    s = validate_model(settings_model(stage.kind), stage.settings, f"{where}, settings")
    if getattr(s, "lr", None) == 0:
        raise SpecError(f"{where}, settings.lr: 0 would train nothing; expected a learning rate > 0")
    problem = s.batch_problem() if isinstance(s, TrainSettings) else None
    if problem:
        raise SpecError(f"{where}, settings.batch_size: {problem}")
