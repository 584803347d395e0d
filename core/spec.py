"""Pipeline specs: pydantic models for the YAML, plugin-aware validation, and the stage DAG."""

from __future__ import annotations

import graphlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from alignflow.core.contracts import StageKind, plugin_config_model
from alignflow.core.errors import PluginError, SpecError

if TYPE_CHECKING:
    from alignflow.core.rounds import LoopSpec, RoundOf

STAGE_REF = "stage:"
DEFAULT_SAMPLER = "hf"  # stages that generate use it unless the spec names another

# What each stage kind reads, which plugins it takes, and which inputs it cannot run without.
TRAIN_INPUTS = {"model", "dataset", "eval_dataset"}
# Training stages may list rewards (and a sampler) to score `eval_dataset` completions at the end.
KIND_RULES: dict[str, dict[str, Any]] = {
    # rewards on a select stage score its prompt/completion rows (`rewards.NAME`) before the selectors run
    "select": {"inputs": {"dataset", "reward_model", "prm"}, "required": {"dataset"},
               "plugins": {"selectors", "rewards"}},
    "sft": {"inputs": TRAIN_INPUTS, "required": {"model", "dataset"},
            "plugins": {"algorithm", "rewards", "sampler"}},
    "reward_model": {"inputs": TRAIN_INPUTS, "required": {"model", "dataset"}, "plugins": {"algorithm"}},
    "prm": {"inputs": TRAIN_INPUTS, "required": {"model", "dataset"}, "plugins": {"algorithm"}},
    "preference": {"inputs": TRAIN_INPUTS | {"reference"}, "required": {"model", "dataset"},
                   "plugins": {"algorithm", "rewards", "sampler"}},
    "rl": {"inputs": TRAIN_INPUTS | {"reference", "reward_model", "prm", "critic", "teacher"},
           "required": {"model", "dataset"}, "plugins": {"algorithm", "rewards", "sampler"},
           "needs_rewards": True},
    "rejection_sampling": {"inputs": {"model", "dataset", "reward_model", "prm"},
                           "required": {"model", "dataset"}, "plugins": {"rewards", "sampler"},
                           "needs_rewards": True},
    # Constitutional AI: `model` answers, critiques its answer against a principle drawn from the `constitution`
    # file and revises it; rewards, when listed, score the original and the revision.
    "critique_revise": {"inputs": {"model", "dataset", "constitution", "reward_model", "prm"},
                        "required": {"model", "dataset", "constitution"}, "plugins": {"rewards", "sampler"},
                        "samples": True},  # generates with or without rewards: its sampler is always filled in
    # Math-Shepherd: `model` samples solutions, `completer` (default: `model`) completes their step
    # prefixes, the rewards judge the completions.
    "step_labels": {"inputs": {"model", "dataset", "completer"}, "required": {"model", "dataset"},
                    "plugins": {"rewards", "sampler"}, "needs_rewards": True},
    "evaluate": {"inputs": {"model", "dataset", "reward_model", "prm"}, "required": {"model", "dataset"},
                 "plugins": {"rewards", "sampler"}, "needs_rewards": True},
}


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


class StageSpec(BaseModel):
    """One stage: its kind, inputs (paths, hub ids or `stage:NAME`), plugins and settings."""

    model_config = ConfigDict(extra="forbid")
    kind: StageKind
    inputs: dict[str, str] = Field(default_factory=dict)
    algorithm: PluginRef | None = None
    rewards: list[RewardRef] = Field(default_factory=list)
    sampler: PluginRef | None = None
    selectors: list[PluginRef] = Field(default_factory=list)
    settings: dict[str, Any] = Field(default_factory=dict)
    # The Prefect work pool whose worker runs this stage (flows/remote.py); None: the pipeline's own
    # process. Where a stage runs is not part of its digest: moving it between pools reuses its artifact.
    pool: str | None = None

    @field_validator("pool")
    @classmethod
    def _pool(cls, v):
        return check_pool_name(v) if v is not None else v

    @field_validator("algorithm", "sampler", mode="before")
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


class PipelineSpec(BaseModel):
    """A pipeline; `stages` is the flat DAG, with each loop (core/rounds.py) unrolled into its rounds."""

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


POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def check_pool_name(name: str) -> str:
    """A work pool name that is also a deployment name (`alignflow-stage/NAME`): no `/`, spaces or quotes."""
    if not POOL_NAME.fullmatch(name):
        raise ValueError(f"{name!r} is not a work pool name: expected letters, digits, '_', '.', '-' "
                         "(starting with a letter or digit)")
    return name


def loc_text(loc: tuple) -> str:
    return ".".join(str(p) for p in loc)


def load_spec(path: str | Path, plugins=None) -> PipelineSpec:
    """Read, validate and check a pipeline YAML; every error names the file, stage and field."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise SpecError(f"{path}: no such pipeline file") from None
    except yaml.YAMLError as exc:
        raise SpecError(f"{path}: not valid YAML: {exc}") from None
    return parse_spec(raw, str(path), plugins)


def parse_spec(raw: Any, source: str = "<spec>", plugins=None) -> PipelineSpec:
    """The validated spec, or one SpecError listing every stage's problems."""
    spec, problems = parse_shape(raw, source)
    problems += plugin_problems(spec, source, plugins, skip=stages_of(problems))
    raise_problems(source, problems)
    return spec


def parse_shape(raw: Any, source: str = "<spec>") -> tuple[PipelineSpec, list[str]]:
    """The spec and each stage's first problem of shape (inputs, which plugins, settings), without
    loading any plugin: the checks `alignflow validate` reports before importing plugin code (and torch).
    A spec that is not a pipeline at all (bad YAML structure, a missing stage, a cycle) raises."""
    from alignflow.core import rounds

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


def plugin_problems(spec: PipelineSpec, source: str, plugins=None, skip: set[str] = frozenset()) -> list[str]:
    """Each stage's first problem with its plugins: unknown names, misplaced algorithms, bad configs."""
    if plugins is None:
        from alignflow.core.plugins import get_plugins

        plugins = get_plugins()
    problems = []
    for name, stage in spec.written().items():
        if name in skip:  # its shape is wrong already; one problem per stage
            continue
        try:
            check_plugins(name, stage, source, plugins)
        except SpecError as exc:
            problems.append(str(exc))
    return problems


def stages_of(problems: list[str]) -> set[str]:
    """The stage names the problems (`...: stage 'x', ...`) are about."""
    return {p.split("stage '", 1)[1].split("'", 1)[0] for p in problems if "stage '" in p}


def raise_problems(source: str, problems: list[str]) -> None:
    if len(problems) == 1:
        raise SpecError(problems[0])
    if problems:
        raise SpecError(f"{source}: {len(problems)} stages have problems:\n" + "\n".join(f"  {p}" for p in problems))


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
    rules = KIND_RULES[stage.kind]
    for field in stage.inputs:
        if field not in rules["inputs"]:
            raise SpecError(f"{where}, inputs.{field}: not an input of a {stage.kind!r} stage "
                            f"(allowed: {', '.join(sorted(rules['inputs']))})")
    for field in sorted(rules["required"] - set(stage.inputs)):
        raise SpecError(f"{where}, inputs.{field}: required by a {stage.kind!r} stage")
    given = {"algorithm": stage.algorithm is not None, "rewards": bool(stage.rewards),
             "sampler": stage.sampler is not None, "selectors": bool(stage.selectors)}
    for field, present in given.items():
        if present and field not in rules["plugins"]:
            raise SpecError(f"{where}, {field}: a {stage.kind!r} stage takes no {field}")
    if "algorithm" in rules["plugins"] and stage.algorithm is None:
        raise SpecError(f"{where}, algorithm: required by a {stage.kind!r} stage")
    if rules.get("needs_rewards") and not stage.rewards:
        raise SpecError(f"{where}, rewards: a {stage.kind!r} stage needs at least one reward")
    if stage.sampler is None and (stage.rewards or rules.get("samples")) and "sampler" in rules["plugins"]:
        stage.sampler = PluginRef(name=DEFAULT_SAMPLER)
    _check_settings(where, stage)


def check_plugins(name: str, stage: StageSpec, source: str, plugins) -> None:
    """The stage's plugins exist, serve its kind, and accept their configs."""
    where = f"{source}: stage {name!r}"
    if stage.algorithm is not None:  # the kind first: an rl config in a preference stage is misplaced, not bad
        algo = _lookup(where, "algorithm", stage.algorithm, plugins.algorithms)
        if getattr(algo, "stage", None) != stage.kind:
            raise SpecError(f"{where}, algorithm: {stage.algorithm.name!r} serves "
                            f"{getattr(algo, 'stage', '?')!r} stages, not {stage.kind!r}")
        validate_config(algo, stage.algorithm.config, f"{where}, algorithm.config")
        _check_teacher(where, stage, algo)
    if stage.sampler is not None:
        _check_ref(where, "sampler", stage.sampler, plugins.samplers)
    for i, ref in enumerate(stage.rewards):
        _check_ref(where, f"rewards[{i}]", ref, plugins.rewards)
    for i, ref in enumerate(stage.selectors):
        _check_ref(where, f"selectors[{i}]", ref, plugins.selectors)


def _check_teacher(where: str, stage: StageSpec, algo) -> None:
    """A `teacher` input exactly when the algorithm learns from one (`requires_teacher`): a teacher that
    nothing reads would still change the stage's digest."""
    wants, given = getattr(algo, "requires_teacher", False), "teacher" in stage.inputs
    if wants and not given:
        raise SpecError(f"{where}, inputs.teacher: algorithm {stage.algorithm.name!r} learns from a teacher; "
                        "give its model path or `stage:NAME`")
    if given and not wants:
        raise SpecError(f"{where}, inputs.teacher: algorithm {stage.algorithm.name!r} uses no teacher")


def _lookup(where: str, field: str, ref: PluginRef, registry):
    try:
        return registry.get(ref.name)
    except PluginError as exc:
        raise SpecError(f"{where}, {field}.name: {exc}") from None


def _check_ref(where: str, field: str, ref: PluginRef, registry):
    obj = _lookup(where, field, ref, registry)
    validate_config(obj, ref.config, f"{where}, {field}.config")
    return obj


def validate_config(obj: Any, config: dict, where: str):
    """Validate a `config:` block with the plugin's own model; None when the plugin takes none."""
    return validate_model(plugin_config_model(obj), config, where)


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


def _check_settings(where: str, stage: StageSpec) -> None:
    """The kind's settings model, then what a pipeline cannot mean: lr 0, batches that do not divide."""
    from alignflow.core.settings import settings_model

    s = validate_model(settings_model(stage.kind), stage.settings, f"{where}, settings")
    if getattr(s, "lr", None) == 0:
        raise SpecError(f"{where}, settings.lr: 0 would train nothing; expected a learning rate > 0")
    micro = getattr(s, "micro_batch_size", None)
    if micro is None:
        return
    size = s.batch_size
    if stage.kind == "rl":
        rollout = s.prompts_per_step * s.group_size
        size = size or rollout
        if rollout % size:
            raise SpecError(f"{where}, settings.batch_size: {size} must divide the rollout, "
                            f"prompts_per_step x group_size = {rollout}")
        if size % s.group_size:  # an optimizer step's minibatch is whole groups: else some are empty
            raise SpecError(f"{where}, settings.batch_size: {size} must be a multiple of group_size={s.group_size} "
                            "(each optimizer step takes whole groups)")
    if size % micro:
        raise SpecError(f"{where}, settings.batch_size: {size} must be a multiple of micro_batch_size={micro}")
