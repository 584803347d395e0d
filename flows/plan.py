"""The run plan: every stage's resolved inputs, validated config and digest, before anything runs."""

from __future__ import annotations

from contextlib import closing
from dataclasses import dataclass
from pathlib import Path

from alignflow.core.rounds import RoundOf, round_seed
from alignflow.core.spec import PipelineSpec, StageSpec
from alignflow.flows import digest as dg


@dataclass(frozen=True)
class StagePlan:
    """One stage as it will run: `inputs` maps each input to a path, hub id or upstream stage name."""

    name: str
    spec: StageSpec
    digest: str
    inputs: dict[str, Path | str]  # local path, hub id, or (for `upstream`) the upstream stage
    upstream: dict[str, str]  # input name -> upstream stage name
    input_digests: dict[str, str]  # input name -> `stage:DIGEST`, `file:SHA256` or `hub:ID`
    config: dict
    versions: dict
    data_version: str | None
    seed: int
    order: int = 0  # position in the pipeline's dependency order: who gets a free stage slot first
    round: RoundOf | None = None  # the loop and round it was unrolled from; None outside loops

    @property
    def kind(self) -> str:
        return self.spec.kind


def runner_version(kind: str) -> dict:
    """The runner's module and a hash of its code and the alignflow code it imports: an edit reruns the stage."""
    from alignflow.flows.stages.registry import RUNNERS

    runner = RUNNERS[kind]
    return {"module": runner.__module__, "source": dg.code_hash(runner.__module__)}


def plan_pipeline(spec: PipelineSpec, project: Path, plugins) -> dict[str, StagePlan]:
    """Plans in dependency order; a stage's digest folds in its upstream stages' digests."""
    from alignflow.flows.execute import RANK_DEPENDENT_KINDS, data_parallel_ranks  # execute imports this module

    data_version = dg.data_version(project)
    plans: dict[str, StagePlan] = {}
    with closing(dg.project_hash_cache(project)) as cache:
        for name in spec.order():
            stage = spec.stages[name]
            upstream = stage.references()
            inputs: dict[str, Path | str] = {}
            input_digests: dict[str, str] = {}
            for field, value in sorted(stage.inputs.items()):
                if field in upstream:
                    inputs[field] = upstream[field]
                    input_digests[field] = f"stage:{plans[upstream[field]].digest}"
                else:
                    inputs[field] = dg.resolve_input(value, project)
                    input_digests[field] = dg.input_digest(inputs[field], cache)
            config = dg.stage_config(name, stage, plugins)
            seed = config["settings"].get("seed")
            seed = spec.seed if seed is None else seed
            if (round_of := spec.round_of(name)) is not None:
                seed = round_seed(seed, round_of.round)
            versions = {"plugins": dg.plugin_versions(stage, plugins), "runner": runner_version(stage.kind)}
            parts = {"kind": stage.kind, "config": config, "inputs": input_digests, "versions": versions,
                     "data_version": data_version, "seed": seed}
            if stage.kind in RANK_DEPENDENT_KINDS and (ranks := data_parallel_ranks(stage.kind)) > 1:
                parts["processes"] = ranks  # absent for one process, so one-process digests stay as they were
            plans[name] = StagePlan(name, stage, dg.stage_digest(parts), inputs, upstream, input_digests,
                                    config, versions, data_version, seed, len(plans), round_of)
    return plans
