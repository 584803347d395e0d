"""The run plan: every stage's resolved inputs, validated config and digest, before anything runs."""

from __future__ import annotations

import time
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from alignflow.core.fingerprint import library_versions
from alignflow.core.spec.kinds import RANK_DEPENDENT_KINDS
from alignflow.core.plugins import get_plugins
from alignflow.core.spec.rounds import RoundOf, round_seed
from alignflow.core.spec.schema import PipelineSpec, ResolvedStage, StageSpec, resolved_stages
from alignflow.flows import digest as dg
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.launch.shutdown import RunGuard
from alignflow.flows.options import RunOptions
from alignflow.flows.preflight import CheckedSpec, check_pipeline
from alignflow.flows.store.url import open_store
from alignflow.flows.tracking import Tracker

if TYPE_CHECKING:
    from alignflow.flows.launch.execute import Launcher


@dataclass(frozen=True)
class StagePlan:
    """One stage as it will run: its blocks resolved (what the digest and the runner read), and its inputs."""

    name: str
    spec: StageSpec
    resolved: ResolvedStage
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
    from alignflow.flows.stages.runners import RUNNERS  # every runner's code and torch: only when planning

    runner = RUNNERS[kind]
    return {"module": runner.__module__, "source": dg.code_hash(runner.__module__)}


def plan_pipeline(spec: PipelineSpec, project: Path, plugins, options: RunOptions = RunOptions(),
                  resolved: dict[str, ResolvedStage] | None = None) -> dict[str, StagePlan]:
    """Plans in dependency order; a stage's digest folds in its upstream stages' digests (and, for a
    rank-dependent kind, the number of ranks `options` gives it); `resolved`: the checked spec's stages (None: here)."""
    resolved = resolved_stages(spec, plugins) if resolved is None else resolved
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
            config = dg.stage_config(stage, resolved[name])
            seed = config["settings"].get("seed")
            seed = spec.seed if seed is None else seed
            if (round_of := spec.round_of(name)) is not None:
                seed = round_seed(seed, round_of.round)
            # the libraries that compute enter every digest (a plugin's `imports` name only its direct ones);
            # the hardware does not, so a cache stays shareable: it is in the manifest's `fingerprint`
            versions = {"plugins": dg.plugin_versions(stage, plugins), "runner": runner_version(stage.kind),
                        "libraries": library_versions()}
            parts = {"kind": stage.kind, "config": config, "inputs": input_digests, "versions": versions,
                     "data_version": data_version, "seed": seed}
            # (a rank-dependent kind is data-parallel: it runs on all of the run's processes)
            if stage.kind in RANK_DEPENDENT_KINDS and (ranks := options.total_processes) > 1:
                parts["processes"] = ranks  # absent for one process, so one-process digests stay as they were
            plans[name] = StagePlan(name, stage, resolved[name], dg.stage_digest(parts), inputs, upstream,
                                    input_digests, config, versions, data_version, seed, len(plans), round_of)
    return plans


@dataclass
class Session:
    """One pipeline run's spec, plans, run options, artifact store and MLflow tracker."""

    spec: PipelineSpec
    spec_text: str  # the spec after overrides: what `reproduce` reruns
    project: Path
    plans: dict[str, StagePlan]
    store: ArtifactStore
    tracker: Tracker
    plugins: object
    options: RunOptions = field(default_factory=RunOptions)
    launcher: Launcher | None = None  # how its stages share this process (flows/launch/execute.py)
    guard: RunGuard = field(default_factory=RunGuard)  # what a stop must stop and close (flows/launch/shutdown.py)
    started: float = field(default_factory=time.perf_counter)


def open_session(pipeline: Path, overrides: list[str], project: Path, artifacts: Path | str | None,
                 options: RunOptions = RunOptions(), checked: CheckedSpec | None = None,
                 guard: RunGuard | None = None) -> Session:
    """Plan every stage of the checked spec (None: check the spec with overrides here, regenerating missing data);
    `guard`: the run's stop state, when a caller holds it (the CLI's signal handlers)."""
    from alignflow.flows.launch.execute import Launcher  # torch and the runners: once a run starts
    checked = checked or check_pipeline(pipeline, overrides, project, regenerate=True)
    plugins = get_plugins()
    plans = plan_pipeline(checked.spec, project, plugins, options, checked.stages)
    store = open_store(artifacts if artifacts is not None else project / "artifacts", options)  # a folder or a URL
    guard = guard or RunGuard()
    return Session(checked.spec, yaml.safe_dump(checked.raw, sort_keys=False), project, plans, store,
                   Tracker(project, checked.spec.name, guard), plugins, options, Launcher(options), guard)
