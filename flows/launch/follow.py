"""A node other than node 0 of a multi-node run: it follows node 0's pipeline and lends it its ranks.

Node 0 runs the pipeline as on one machine: Prefect, MLflow, the stage locks, caching, finalising. Every
other node runs the same command (same spec, code and data, so the same digests) with the same shared
`--artifacts` folder, plans the stages, and for each one, once the stages it reads from are finished
(their manifests, written last by node 0, are in the shared folder):
- a data-parallel kind (DATA_PARALLEL_KINDS) not finished yet: this node's `--nproc` ranks join the
  stage's rendezvous (run id: its digest), then the node waits for node 0 to finish the stage;
- any other kind: it waits for node 0's manifest.
It never locks, writes or finalises an artifact: node 0 owns them all. Each stage waits in its own
thread, so stages that node 0 runs at once are joined at once, whatever order it starts them in.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from alignflow.core.errors import AlignflowError
from alignflow.core.plugins import get_plugins
from alignflow.core.spec.kinds import DATA_PARALLEL_KINDS
from alignflow.flows.store.artifacts import ArtifactStore
from alignflow.flows.launch.execute import StageOutcome, resolve_inputs, thread_share
from alignflow.flows.launch.nodes import connect, run_ended
from alignflow.flows.options import RunOptions
from alignflow.flows.plan import StagePlan, plan_pipeline
from alignflow.flows.preflight import CheckedSpec
from alignflow.flows.launch.ranks import run_ranks
from alignflow.flows.stages import StageContext

log = logging.getLogger(__name__)
POLL_S = 1.0


class NodeStopped(AlignflowError):
    """Node 0's run ended without finishing a stage this node waits for, or a stage failed here."""


def follow_pipeline(checked: CheckedSpec, project: Path, artifacts: Path | str | None,
                    options: RunOptions) -> dict[str, str]:
    """Follow node 0's run of the checked pipeline to its end, on the node `options.nodes` names; {stage: how it
    went here}. Raises NodeStopped naming the first stage that failed (here or on node 0)."""
    nodes, spec, plugins = options.nodes, checked.spec, get_plugins()
    plans = plan_pipeline(spec, project, plugins, options, checked.stages)
    store = ArtifactStore(Path(artifacts).resolve() if artifacts is not None else project / "artifacts")
    log.info("node %d of %d: waiting for node 0 at %s", nodes.rank, nodes.count, nodes.endpoint)
    board = connect(nodes)  # waits for node 0's store
    order = spec.order()
    done: dict[str, StageOutcome | None] = {}  # None: failed or skipped
    ready = {name: threading.Event() for name in order}
    statuses: dict[str, str] = {}
    errors: list[BaseException] = []

    def follow(name: str) -> None:
        plan = plans[name]
        try:
            for stage in set(plan.upstream.values()):
                ready[stage].wait()
            if any(done[s] is None for s in plan.upstream.values()):
                statuses[name] = "skipped"
                done[name] = None
                return
            done[name], statuses[name] = _follow_stage(plan, done, store, board, options, plugins)
        except BaseException as exc:  # noqa: BLE001 - reported once every stage has stopped
            errors.append(exc)
            statuses[name], done[name] = "failed", None
            log.error("node %d: stage %r failed: %s", nodes.rank, name, exc)
        finally:
            ready[name].set()

    with ThreadPoolExecutor(max_workers=len(order), thread_name_prefix="alignflow-follow") as pool:
        list(pool.map(follow, order))
    if errors:
        raise NodeStopped(f"node {nodes.rank}: {errors[0]}") from errors[0]
    return statuses


def _follow_stage(plan: StagePlan, done: dict, store: ArtifactStore, board, options: RunOptions, plugins):
    """(outcome, status) of one stage on this node: joined with its ranks, or waited for."""
    nodes = options.nodes
    manifest = store.manifest(plan.name, plan.digest)
    status = "cached"
    if manifest is None and plan.kind in DATA_PARALLEL_KINDS:
        _lend_ranks(plan, done, store, options, plugins)
        status = "ran"
    elif manifest is None:
        status = "waited"
    manifest = manifest or _wait_for_manifest(plan, store, board)
    outcome = StageOutcome(plan.name, plan.kind, status, 0.0, plan.digest, store.folder(plan.name, plan.digest),
                           store.outputs(manifest, plan.name), manifest["metrics"], manifest.get("headline"))
    log.info("node %d: stage %r %s", nodes.rank, plan.name, "done with node 0" if status == "ran" else status)
    return outcome, status


def _lend_ranks(plan: StagePlan, done: dict, store: ArtifactStore, options: RunOptions, plugins) -> None:
    """Run this node's ranks of the stage, in node 0's work and checkpoint folders (shared)."""
    ctx = StageContext(
        name=plan.name, spec=plan.spec, settings=plan.resolved.settings, resolved=plan.resolved,
        inputs=resolve_inputs(plan, done), work_dir=store.work_dir(plan.name, plan.digest),
        checkpoint_dir=store.checkpoint_dir(plan.name, plan.digest), seed=plan.seed, plugins=plugins,
        world=options.total_processes, options=options,
        log_metrics=lambda metrics, step: None,  # rank 0, on node 0, reports the stage
    )
    local = options.nproc
    threads = thread_share(thread_share(torch.get_num_threads(), options.parallel_stages), local)
    log.info("node %d: stage %r: joining its rendezvous with %d rank%s", options.nodes.rank, plan.name, local,
             "s" if local > 1 else "")
    run_ranks(plan.kind, ctx, threads, local, options.nodes)


def _wait_for_manifest(plan: StagePlan, store: ArtifactStore, board) -> dict:
    """Node 0's manifest of the stage, once it is written; NodeStopped if node 0's run ends first."""
    while (manifest := store.manifest(plan.name, plan.digest)) is None:
        if run_ended(board):
            manifest = store.manifest(plan.name, plan.digest)  # written just before the end
            if manifest is not None:
                return manifest
            raise NodeStopped(f"node 0's run ended without finishing stage {plan.name!r} (digest "
                              f"{plan.digest[:12]}): it failed or was skipped there, see node 0's output")
        time.sleep(POLL_S)
    return manifest
