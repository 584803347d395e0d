"""Run one planned stage: reuse its artifact when finished, else lock, run, finalise and record."""

from __future__ import annotations

import contextlib
import heapq
import importlib.metadata as md
import logging
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from alignflow.core.errors import AlignflowError, SpecError
from alignflow.core.fingerprint import fingerprint
from alignflow.core.spec.kinds import DATA_PARALLEL_KINDS, THREAD_SAFE_KINDS
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.launch.child import can_run_in_child, run_in_child
from alignflow.flows.options import NPROC_ENV, RunOptions
from alignflow.flows.launch.ranks import run_ranks
from alignflow.flows.stages import OUTPUT_OF_INPUT, StageContext, StageResult
from alignflow.flows.stages.runners import RUNNERS
from alignflow.flows.tracking import StageRun, Tracker, fingerprint_tags

if TYPE_CHECKING:
    from alignflow.flows.plan import StagePlan  # the plan creates a run's Launcher: no import back at run time

log = logging.getLogger(__name__)


@dataclass
class StageOutcome:
    """How a stage ended, for the summary, downstream stages and MLflow."""

    name: str
    kind: str
    status: str  # ran | cached | resumed
    seconds: float
    digest: str
    artifact: Path
    outputs: dict[str, Path] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    headline: str | None = None
    mlflow_run_id: str | None = None


# What the Prefect UI shows for a stage that did not run its runner from the start.
STATE_NAMES = {"cached": "Cached", "resumed": "Resumed"}


def data_parallel_ranks(kind: str, options: RunOptions) -> int:
    """Processes a stage of `kind` trains on, on all nodes together: `options.total_processes` for the
    data-parallel kinds, else 1."""
    ranks = options.total_processes
    if kind not in DATA_PARALLEL_KINDS:
        if ranks > 1:
            log.info("a %s stage runs on one process: %s=%d applies to %s stages", kind, NPROC_ENV, ranks,
                     ", ".join(sorted(DATA_PARALLEL_KINDS)))
        return 1
    return ranks


class OrderedSlots:
    """`n` stage slots; of the stages waiting for one, the first in the pipeline's order gets it. A
    stage waits `SETTLE_S` before taking a free slot, so that siblings made ready by the same upstream
    stage all queue first (an evaluation listed before a long RL stage then runs before it)."""

    SETTLE_S = 0.25

    def __init__(self, n: int):
        self.free, self.waiting, self.cond = n, [], threading.Condition()

    @contextlib.contextmanager
    def held(self, rank: tuple):
        with self.cond:
            heapq.heappush(self.waiting, rank)
            self.cond.wait(self.SETTLE_S)
            while not (self.free > 0 and self.waiting[0] == rank):
                self.cond.wait()
            heapq.heappop(self.waiting)
            self.free -= 1
            self.cond.notify_all()
        try:
            yield
        finally:
            with self.cond:
                self.free += 1
                self.cond.notify_all()


class Launcher:
    """How one run starts its stages here (its session owns one): `options.parallel_stages` ordered slots, and this
    process, where one stage at a time runs on its share of the threads (else a child on the same share)."""

    def __init__(self, options: RunOptions = RunOptions()):
        self.options, self.slots, self.here = options, OrderedSlots(options.parallel_stages), threading.Lock()
        self.user_threads: int | None = None  # this process's torch threads while a stage here runs on its share

    def call_runner(self, kind: str, ctx: StageContext, started: list[float], order: int = 0) -> StageResult:
        """`RUNNERS[kind](ctx)` once a slot is free: here when this process is free for it, else in a child
        process (`ctx.world` ranks: as many processes). Appends the time the runner started (after any wait)
        to `started`."""
        if kind in THREAD_SAFE_KINDS and not ctx.spec.rewards:
            started.append(time.time())
            return RUNNERS[kind](ctx)
        n = self.options.parallel_stages
        if n > 1 and getattr(ctx.settings, "async_rollouts", None) == "auto":  # the cores are the other stages'
            ctx = replace(ctx, settings=ctx.settings.model_copy(update={"async_rollouts": False}))
        with self.slots.held((order, ctx.name)):
            if ctx.world > 1:
                if not can_run_in_child(ctx.plugins):
                    raise SpecError(f"stage {ctx.name!r}: {NPROC_ENV}={ctx.world} starts one process per rank, "
                                    "which cannot rebuild plugins defined in __main__ or inside a function, nor "
                                    "run under another launcher's process group")
                started.append(time.time())
                local = self.options.nproc  # this node's share of the ranks
                threads = thread_share(thread_share(self.user_threads or torch.get_num_threads(), n), local)
                return run_ranks(kind, ctx, threads, local, self.options.nodes)
            if self.here.acquire(blocking=False):
                return self._run_here(kind, ctx, started)
            if can_run_in_child(ctx.plugins):
                started.append(time.time())
                return run_in_child(kind, ctx, threads=thread_share(self.user_threads or torch.get_num_threads(), n))
            self.here.acquire()
            return self._run_here(kind, ctx, started)

    def _run_here(self, kind: str, ctx: StageContext, started: list[float]) -> StageResult:
        """Run in this process on its share of the threads; `here` is held and released here."""
        user = self.user_threads = torch.get_num_threads()
        try:
            torch.set_num_threads(thread_share(user, self.options.parallel_stages))
            started.append(time.time())
            return RUNNERS[kind](ctx)
        finally:
            torch.set_num_threads(user)
            self.user_threads = None
            self.here.release()

    def stage_threads(self, kind: str, ctx: StageContext) -> int:
        """The torch threads `call_runner` gives a stage (each rank's, for a data-parallel one)."""
        if kind in THREAD_SAFE_KINDS and not ctx.spec.rewards:
            return torch.get_num_threads()
        threads = thread_share(self.user_threads or torch.get_num_threads(), self.options.parallel_stages)
        return thread_share(threads, self.options.nproc) if ctx.world > 1 else threads


def thread_share(threads: int, n: int) -> int:
    """Each of `n` sharers' part of `threads` torch threads, at least 1."""
    return max(1, threads // n)


class StageFailed(AlignflowError):
    """A stage's runner raised; `seconds` is how long it ran."""


def resolve_inputs(plan: StagePlan, upstream: dict[str, StageOutcome]) -> dict[str, Path | str]:
    """Replace `stage:NAME` inputs by the upstream output matching the input's name."""
    inputs = dict(plan.inputs)
    for field_name, stage in plan.upstream.items():
        wanted = OUTPUT_OF_INPUT[field_name]
        outputs = upstream[stage].outputs
        if wanted not in outputs:
            raise SpecError(f"stage {plan.name!r}, inputs.{field_name}: stage {stage!r} has no "
                            f"{wanted!r} output (it has: {', '.join(outputs) or 'none'})")
        inputs[field_name] = outputs[wanted]
    return inputs


def stage_tags(plan: StagePlan) -> dict[str, str]:
    tags = {"alignflow.stage": plan.name, "alignflow.kind": plan.kind, "alignflow.digest": plan.digest,
            "alignflow.data_version": str(plan.data_version)}
    for name, v in plan.versions["plugins"].items():
        tags[f"plugin.{name}"] = f"{v['distribution']} {v['version']} {str(v['source'])[:12]}"
    if plan.round is not None:  # search a loop's runs by round: `tags."alignflow.round" = '2'`
        tags.update({"alignflow.loop": plan.round.loop, "alignflow.loop_stage": plan.round.stage,
                     "alignflow.round": str(plan.round.round)})
    return tags


def execute_stage(plan: StagePlan, upstream: dict[str, StageOutcome], store: ArtifactStore,
                  tracker: Tracker, plugins, launcher: Launcher) -> StageOutcome:
    """Cached when the manifest exists; otherwise run under the artifact lock."""
    start = time.perf_counter()
    inputs = resolve_inputs(plan, upstream)
    run = tracker.stage_run(plan.name, plan.config, stage_tags(plan))
    # Holding the lock across check-and-run: a concurrent run of the same stage waits, then reuses.
    with store.lock(plan.name, plan.digest):
        manifest = store.manifest(plan.name, plan.digest)
        if manifest is None or not reusable(store, plan.name, plan.digest, manifest):
            for stage in sorted(set(plan.upstream.values())):  # a shared store's inputs: downloaded once
                store.fetch(stage, upstream[stage].digest)
            manifest = _run(plan, inputs, store, run, plugins, launcher)
            # the runner's own time, not a wait for this process while a sibling stage held it
            status, seconds = manifest["status"], manifest["timings"]["seconds"]
        else:
            status, seconds = "cached", time.perf_counter() - start
    outcome = StageOutcome(plan.name, plan.kind, status, seconds, plan.digest,
                           store.folder(plan.name, plan.digest), store.outputs(manifest, plan.name),
                           manifest["metrics"], manifest.get("headline"), run.run_id)
    # a cached stage's tags say where its outputs were computed, not where they were reused
    run.finish(status, outcome.metrics, fingerprint_tags(manifest.get("fingerprint") or {}),
               outcome.artifact / "manifest.json")
    return outcome


def reusable(store: ArtifactStore, stage: str, digest: str, manifest: dict) -> bool:
    """Whether a finished stage's outputs here are as published, once a copy that changed after its download
    from a shared store is downloaded again (which raises when the store's own copy is not as published)."""
    problem = store.damaged(stage, digest, manifest)
    if problem is None:
        return True
    log.warning("stage %r: its cached outputs here changed after they were published (%s)", stage, problem)
    store.fetch(stage, digest, again=True)  # a shared store's copy comes down again; a local store's is the only one
    problem = store.damaged(stage, digest, manifest)
    if problem is not None:
        log.warning("stage %r: running it again (%s)", stage, problem)
    return problem is None


def blamed_plugin(exc: BaseException, stage, plugins) -> str | None:
    """"<kind> '<name>' (<distribution> <version>)" of the stage's plugin whose code raised: the innermost
    traceback frame in its module (in any module of its package, for a plugin outside alignflow)."""
    refs = [("algorithm", stage.algorithm, plugins.algorithms), ("sampler", stage.sampler, plugins.samplers)]
    refs += [("reward", r, plugins.rewards) for r in stage.rewards]
    refs += [("selector", r, plugins.selectors) for r in stage.selectors]
    refs += [("environment", stage.environment, plugins.environments)]
    owners = []
    for kind, ref, registry in refs:
        try:
            entry = registry.entry(ref.name) if ref is not None else None
        except AlignflowError:
            continue
        if entry is not None:
            module = getattr(entry.obj, "__module__", None) or ""
            scope = module if module.startswith("alignflow.") else module.partition(".")[0]
            owners.append((scope, f"{kind} {ref.name!r} ({entry.distribution} {entry.version})"))
    blamed = None
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        name = frame.f_globals.get("__name__", "")
        for scope, label in owners:
            if scope and (name == scope or name.startswith(scope + ".")):
                blamed = label
    return blamed


class EmptyOutput(AlignflowError):
    """A stage wrote a dataset of no rows where its settings do not allow that."""


def refuse_empty(ctx: StageContext, result: StageResult) -> None:
    """A dataset output with no rows fails the stage (never cached) unless `allow_empty` is set."""
    path = result.outputs.get("dataset")
    if path is None or getattr(ctx.settings, "allow_empty", True) or not Path(path).is_file():
        return
    with open(path, "rb") as f:
        if any(line.strip() for line in f):
            return
    shown = ", ".join(f"{k} {v:.4g}" for k, v in list(result.metrics.items())[:8])
    raise EmptyOutput(f"stage {ctx.name!r} wrote no rows to {Path(path).name} ({shown or 'no metrics'}); "
                      "the next stage would have nothing to train on. Set `allow_empty: true` in its "
                      "settings where an empty output is expected")


def _run(plan: StagePlan, inputs: dict, store: ArtifactStore, run: StageRun, plugins, launcher: Launcher) -> dict:
    """Call the runner in a fresh work dir and finalise its artifact; returns the manifest."""
    ctx = StageContext(
        name=plan.name, spec=plan.spec,
        settings=plan.resolved.settings, resolved=plan.resolved,
        inputs=inputs, work_dir=store.fresh_work_dir(plan.name, plan.digest),
        checkpoint_dir=store.checkpoint_dir(plan.name, plan.digest),
        seed=plan.seed, log_metrics=run.log_metrics, plugins=plugins,
        world=data_parallel_ranks(plan.kind, launcher.options), options=launcher.options,
    )
    resumed = ctx.resuming()
    # the environment the stage computes in (core/fingerprint.py), with the plugin distributions it uses
    env = fingerprint(ctx.settings, {v["distribution"]: v["version"] for v in plan.versions["plugins"].values()},
                      launcher.stage_threads(plan.kind, ctx))
    clock = []
    try:
        result = launcher.call_runner(plan.kind, ctx, clock, plan.order)
        started = clock[0]
        refuse_empty(ctx, result)
    except Exception as exc:
        seconds = time.time() - clock[0] if clock else 0.0
        culprit = blamed_plugin(exc, plan.spec, plugins)
        where = f" in {culprit}" if culprit else ""
        error = f"{where.strip()} {type(exc).__name__}: {exc}"[:5000]
        run.finish("failed", {}, {"alignflow.error": error, **fingerprint_tags(env)}, None)
        failed = StageFailed(f"stage {plan.name!r} failed after {seconds:.1f} s{where}: {type(exc).__name__}: {exc}")
        failed.seconds = seconds
        raise failed from exc
    finished = time.time()
    env = {**env, **result.fingerprint}
    manifest = {
        "digest": plan.digest, "stage": plan.name, "kind": plan.kind,
        "status": "resumed" if resumed else "ran",
        "inputs": {k: {"spec": plan.spec.inputs[k], "resolved": str(inputs[k]),
                       "digest": plan.input_digests[k]} for k in plan.spec.inputs},
        "config": plan.config, "seed": plan.seed, "data_version": plan.data_version,
        "versions": {**plan.versions, "alignflow": md.version("alignflow")},
        "metrics": result.metrics, "headline": result.headline,
        "timings": {"started": started, "finished": finished, "seconds": finished - started},
        "fingerprint": env,
        "mlflow_run_id": run.run_id,
    }
    if plan.round is not None:
        manifest["round"] = {"loop": plan.round.loop, "stage": plan.round.stage, "round": plan.round.round}
    return store.finalise(plan.name, plan.digest, result.outputs, manifest, run.curves)
