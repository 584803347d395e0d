"""Loops in a pipeline spec: a chain of stages repeated `repeat` times, each round reading the one before.

    stages:
      sft: {kind: sft, ...}
      self_improve:                   # a loop: `repeat`, its own `stages`, what round 1 reads
        repeat: 3
        first: {dpo: "stage:sft"}     # in round 1, `stage:dpo@prev` is stage:sft
        stages:
          sample: {kind: rejection_sampling, inputs: {model: "stage:dpo@prev", ...}, ...}
          dpo: {kind: preference, inputs: {model: "stage:dpo@prev", dataset: "stage:sample"}, ...}
      final_eval: {kind: evaluate, inputs: {model: "stage:self_improve.dpo", ...}}  # the last round's dpo

Unrolled, round r of the loop's stage X is the ordinary stage `X.r<r>` (its own digest, artifact folder,
cache and MLflow run). Inside the loop `stage:X` is X of the same round and `stage:X@prev` X of the
previous round (`first.X` in round 1); outside it `stage:LOOP.X` is X of the last round and `stage:X.r2`
one round. The number of rounds enters no digest, so raising `repeat` runs the new rounds only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from alignflow.core.errors import SpecError
from alignflow.core.spec.stage import STAGE_REF, StageSpec, loc_text

PREV = "prev"  # `stage:X@prev`
ROUND_NAME = re.compile(r"(?P<stage>.+)\.r(?P<round>[1-9][0-9]*)")
NOT_IN_NAMES = ".@"  # `stage:LOOP.X` and `stage:X@prev` split on them


def round_name(stage: str, round_: int) -> str:
    """The unrolled name of a loop stage's round: valid as a folder, Prefect task and MLflow run name."""
    return f"{stage}.r{round_}"


def round_seed(seed: int, round_: int) -> int:
    """Round r runs with seed + r - 1: rounds whose inputs are equal (a `select` drawing each round's prompts
    from one file) draw differently, and round 1 keeps the stage's own seed. No round count enters it."""
    return seed + round_ - 1


@dataclass(frozen=True)
class RoundOf:
    """Where an unrolled stage comes from: its loop, its name inside the loop, its round (from 1)."""

    loop: str
    stage: str
    round: int

    @property
    def label(self) -> str:
        return f"{self.loop}.{self.stage}"


def is_loop(value: Any) -> bool:
    """A `stages:` entry that declares a loop rather than a stage (it has no `kind`)."""
    return isinstance(value, dict) and "kind" not in value and ("repeat" in value or "stages" in value)


class LoopSpec(BaseModel):
    """A loop block: how many rounds, its stages, and what round 1 reads for each `stage:X@prev`."""

    model_config = ConfigDict(extra="forbid")
    repeat: int
    first: dict[str, str] = Field(default_factory=dict)
    stages: dict[str, StageSpec]

    @field_validator("repeat", mode="before")
    @classmethod
    def _rounds(cls, v):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise PydanticCustomError("repeat", "expected an integer >= 1, got {got}", {"got": repr(v)})
        return v

    @field_validator("stages", mode="before")
    @classmethod
    def _flat(cls, v):
        if isinstance(v, dict) and not v:
            raise PydanticCustomError("empty", "a loop needs at least one stage")
        for name, stage in (v.items() if isinstance(v, dict) else ()):
            if is_loop(stage):
                raise PydanticCustomError("nested", "{name} is a loop: loops do not nest", {"name": repr(name)})
        return v


def split_loops(raw: dict) -> tuple[dict, dict[str, Any], list[str]]:
    """(the spec without its loops, {loop name: its raw block}, every `stages:` name in order)."""
    stages = raw.get("stages")
    if not isinstance(stages, dict):
        return raw, {}, []
    loops = {name: block for name, block in stages.items() if is_loop(block)}
    plain = {**raw, "stages": {name: s for name, s in stages.items() if name not in loops}}
    return plain, loops, list(stages)


def validate_loops(raw: dict[str, Any]) -> tuple[dict[str, LoopSpec], list[tuple[str, str]]]:
    """Each loop block validated; the errors as (`stages.LOOP.field`, message)."""
    loops, errors = {}, []
    for name, block in raw.items():
        try:
            loops[name] = LoopSpec.model_validate(block)
        except ValidationError as exc:
            errors += [(loc_text(("stages", name, *e["loc"])), e["msg"]) for e in exc.errors()]
    return loops, errors


class _Bad(Exception):
    """One reference that does not resolve; its message is a problem line."""


class Unroller:
    """Turns top-level stages and loops into one flat DAG of ordinary stages; `problems` lists what is wrong."""

    def __init__(self, stages: dict[str, StageSpec], loops: dict[str, LoopSpec], source: str):
        self.stages, self.loops, self.source = stages, loops, source
        self.owner = {x: name for name, loop in loops.items() for x in loop.stages}  # loop stage -> its loop
        self.problems: list[str] = []

    def bad(self, path: str, message: str) -> _Bad:
        return _Bad(f"{self.source}: {path}: {message}")

    def check_names(self) -> None:
        """Names that `stage:LOOP.X` / `X@prev` could not parse, or whose rounds would collide."""
        seen: dict[str, str] = {}
        for name, loop in self.loops.items():
            if any(c in name for c in NOT_IN_NAMES):
                self.problems.append(f"{self.source}: stages.{name}: a loop's name cannot hold '.' or '@'")
            for x in loop.stages:
                path = f"stages.{name}.stages.{x}"
                if any(c in x for c in NOT_IN_NAMES):
                    self.problems.append(f"{self.source}: {path}: a loop stage's name cannot hold '.' or '@'")
                elif x in self.stages:
                    self.problems.append(f"{self.source}: {path}: also the name of a stage outside the loop; "
                                         f"inside it `stage:{x}` would be ambiguous: rename one")
                elif x in seen:
                    self.problems.append(f"{self.source}: {path}: loop {seen[x]!r} has a stage {x!r} too; both "
                                         f"would unroll to {round_name(x, 1)}, ...: rename one")
                seen.setdefault(x, name)
        for name in self.stages:
            m = ROUND_NAME.fullmatch(name)
            loop = self.loops.get(self.owner.get(m["stage"], "")) if m else None
            if loop is not None and int(m["round"]) <= loop.repeat:
                self.problems.append(f"{self.source}: stages.{name}: round {m['round']} of stage {m['stage']!r} "
                                     f"of loop {self.owner[m['stage']]!r} has that name: rename it")

    def outside(self, value: str, path: str, loop: str | None = None) -> str:
        """`value` read from outside `loop`: `stage:L.X` becomes X's last round; the rest stays as written."""
        if not value.startswith(STAGE_REF):
            return value
        name, at, _ = value[len(STAGE_REF):].partition("@")
        if at and loop is not None:  # a `first` entry: what round 1 reads, before any round
            raise self.bad(path, f"{value}: round 1 has no previous round; give a stage outside the loop, "
                                 "a path or a hub id")
        if at:
            raise self.bad(path, f"{value} outside a loop: `@{PREV}` reads the previous round of a stage "
                                 "of the loop the reading stage is in")
        head, dot, tail = name.partition(".")
        if dot and head in self.loops:
            if head == loop:
                raise self.bad(path, f"{value} is this loop's own last round, which round 1 cannot read")
            if tail not in self.loops[head].stages:
                raise self.bad(path, f"{value} names no stage of loop {head!r} "
                                     f"(its stages: {', '.join(self.loops[head].stages)})")
            return STAGE_REF + round_name(tail, self.loops[head].repeat)
        m = ROUND_NAME.fullmatch(name)
        if m and m["stage"] in self.owner and name not in self.stages:
            of, r = self.owner[m["stage"]], int(m["round"])
            if of == loop:
                raise self.bad(path, f"{value} names one round of this loop; inside it read `stage:{m['stage']}` "
                                     f"(this round) or `stage:{m['stage']}@{PREV}` (the previous one)")
            if r > self.loops[of].repeat:
                raise self.bad(path, f"{value} reads a later round than loop {of!r} has: it repeats "
                                     f"{self.loops[of].repeat} times")
        elif name in self.owner and name not in self.stages:
            of = self.owner[name]
            raise self.bad(path, f"{value}: {name!r} is a stage of loop {of!r}; read `stage:{of}.{name}` "
                                 f"(its last round) or `stage:{round_name(name, 1)}` (one round)")
        elif loop is not None and name not in self.stages:  # outside loops, check_graph says it
            raise self.bad(path, f"{value} refers to stage {name!r}, which does not exist "
                                 f"(stages outside the loop: {', '.join(self.stages) or 'none'})")
        return value

    def inside(self, loop: str, value: str, path: str) -> Callable[[int], str]:
        """`value` read by a stage of `loop`, as a function of the round."""
        if not value.startswith(STAGE_REF):
            return lambda r: value
        spec = self.loops[loop]
        name, at, suffix = value[len(STAGE_REF):].partition("@")
        if at:
            if suffix != PREV:
                raise self.bad(path, f"{value}: unknown `@{suffix}`; `@{PREV}` reads the previous round "
                                     "(a stage cannot read a later round)")
            if name not in spec.stages:
                raise self.bad(path, f"{value}: {name!r} is not a stage of loop {loop!r} "
                                     f"(its stages: {', '.join(spec.stages)})")
            if name not in spec.first:
                raise self.bad(path, f"{value} needs first.{name}: what round 1 reads in its place")
            first = self.outside(spec.first[name], f"stages.{loop}.first.{name}", loop)
            return lambda r: first if r == 1 else STAGE_REF + round_name(name, r - 1)
        if name in spec.stages:
            return lambda r: STAGE_REF + round_name(name, r)
        head, dot, tail = name.partition(".")
        if dot and head == loop:
            raise self.bad(path, f"{value} would read this loop's last round; inside it read `stage:{tail}` "
                                 f"(this round) or `stage:{tail}@{PREV}` (the previous one)")
        resolved = self.outside(value, path, loop)
        return lambda r: resolved

    def unroll(self, order: list[str]) -> tuple[dict[str, StageSpec], dict[str, RoundOf]]:
        """The flat stages in `order` (a loop's rounds where it stands) and each unrolled stage's round."""
        self.check_names()
        flat: dict[str, StageSpec] = {}
        rounds: dict[str, RoundOf] = {}
        for name in order:
            if name not in self.loops:
                inputs = {f: self._try(lambda: self.outside(v, f"stages.{name}.inputs.{f}"), v)
                          for f, v in self.stages[name].inputs.items()}
                flat[name] = self.stages[name].model_copy(update={"inputs": inputs})
                continue
            loop = self.loops[name]
            reads = {x: {f: self._try(lambda: self.inside(name, v, f"stages.{name}.stages.{x}.inputs.{f}"),
                                      lambda r, v=v: v)
                         for f, v in stage.inputs.items()} for x, stage in loop.stages.items()}
            self._check_first(name)
            for r in range(1, loop.repeat + 1):
                for x, stage in loop.stages.items():
                    inputs = {f: at(r) for f, at in reads[x].items()}
                    flat[round_name(x, r)] = stage.model_copy(update={"inputs": inputs})
                    rounds[round_name(x, r)] = RoundOf(name, x, r)
        problems = list(dict.fromkeys(self.problems))  # a `first` entry read by two inputs is one problem
        if len(problems) == 1:
            raise SpecError(problems[0])
        if problems:
            lines = "\n".join(f"  {p}" for p in problems)
            raise SpecError(f"{self.source}: {len(problems)} problems with loops and their references:\n{lines}")
        return flat, rounds

    def _check_first(self, loop: str) -> None:
        """Each `first` entry names a loop stage that some stage reads with `@prev`."""
        spec = self.loops[loop]
        read = {v[len(STAGE_REF):].partition("@")[0] for stage in spec.stages.values() for v in stage.inputs.values()
                if v.startswith(STAGE_REF) and v.endswith("@" + PREV)}
        for x in spec.first:
            path = f"{self.source}: stages.{loop}.first.{x}"
            if x not in spec.stages:
                self.problems.append(f"{path}: not a stage of loop {loop!r} (its stages: {', '.join(spec.stages)})")
            elif x not in read:
                self.problems.append(f"{path}: no stage of the loop reads `stage:{x}@{PREV}`")

    def _try(self, resolve: Callable[[], Any], fallback: Any) -> Any:
        try:
            return resolve()
        except _Bad as exc:
            self.problems.append(str(exc))
            return fallback


def unroll(stages: dict[str, StageSpec], loops: dict[str, LoopSpec], order: list[str],
           source: str) -> tuple[dict[str, StageSpec], dict[str, RoundOf]]:
    """The flat DAG of a spec with loops, or one SpecError naming the file and field of each bad reference."""
    return Unroller(stages, loops, source).unroll(order)
