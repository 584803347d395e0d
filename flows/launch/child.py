"""Run a stage's runner in a child process, so independent training stages of one pipeline overlap.

Training runners own process-wide state: torch's global RNG (they seed it), DeepSpeed's process
group, transformers' lazy imports. Two of them in threads of one process corrupt each other, so the
pipeline runs the first training stage in its own process and any stage that would have to wait for
it in a fresh child (`spawn`: no inherited locks or threads). The child rebuilds the stage context
from plain data, sends its step metrics back as they come (the parent logs them to MLflow) and
ends with the result or the error. A stage gives the same result in either place: same seed, same
code, and the same share of torch threads (flows/launch/execute.py gives both the same). A child stops
when the pipeline's process dies, so no orphan keeps writing into a stage that a rerun resumes.

With `ranks > 1`, or on several nodes, the stage runs data-parallel (flows/launch/ranks.py): torch's elastic
launcher (flows/launch/nodes.py) starts one process per rank in one process group, rank 0 reports metrics and the
result, and any rank's failure stops every rank, on every node, with the failed rank named.
"""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import pickle
import queue as queue_mod
import sys
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

from alignflow.core.errors import AlignflowError
from alignflow.core.plugins import entry_point_names, get_plugins
from alignflow.core.spec.kinds import settings_model
from alignflow.core.spec.schema import StageSpec
from alignflow.core.train import own_group
from alignflow.flows.options import RunOptions
from alignflow.flows.stages import StageContext, StageResult

# Variables `core.engine.init_distributed` sets for torch when it forms a one-process group itself.


class _Stderr(logging.StreamHandler):
    """A handler on whatever `sys.stderr` is when a line is written (a redirect, a test's capture), not on the
    stream that was current when logging was configured, which may be closed since."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value):
        pass


def configure_logging() -> None:
    """alignflow's own INFO lines (progress off a terminal, resumes) go to stderr; other libraries keep theirs."""
    logger = logging.getLogger("alignflow")
    if not logger.handlers:
        handler = _Stderr()
        handler.setFormatter(logging.Formatter("%(asctime)s | %(name)s | %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


class ChildFailed(AlignflowError):
    """The child raised (its traceback is in the message) or died without a result."""


def _import_path(obj: Any) -> str | None:
    """`module` or `module:qualname` that imports back to `obj` itself, or None."""
    if isinstance(obj, types.ModuleType):
        name = obj.__name__
    else:
        name = f"{getattr(obj, '__module__', '')}:{getattr(obj, '__qualname__', '')}"
    if name.startswith("__main__") or "<locals>" in name:
        return None
    try:
        return name if _resolve(name) is obj else None
    except Exception:
        return None


def _resolve(path: str) -> Any:
    module, _, attr = path.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, attr.split(".")):
        obj = getattr(obj, part)
    return obj


def plugin_recipe(plugins) -> list[tuple[str, str, str, str]] | None:
    """How a child rebuilds `plugins`: the plugins beyond the entry points (which it loads itself),
    as (import path, name, distribution, version); None when one of them cannot be imported by name
    (defined in __main__ or inside a function), so the stage must run in this process."""
    from_entry_points = entry_point_names()
    extra = []
    for name, (dist, version, _) in plugins.origin.items():
        if name in from_entry_points:
            continue
        path = _import_path(plugins.pm.get_plugin(name))
        if path is None:
            return None
        extra.append((path, name, dist, version))
    return extra


def can_run_in_child(plugins) -> bool:
    """Not under a multi-process launcher (a child would leave its group), and plugins rebuildable."""
    launched = "RANK" in os.environ and not own_group.marked()
    return not launched and plugin_recipe(plugins) is not None


def stage_payload(kind: str, ctx: StageContext, threads: int, world: int = 1) -> dict:
    """The stage as plain data that a spawned child (`world` ranks in all) rebuilds its context from."""
    return {
        "kind": kind, "name": ctx.name, "spec": ctx.spec.model_dump(mode="json", by_alias=True),
        "settings": ctx.settings.model_dump(mode="json", by_alias=True),
        "inputs": {k: (isinstance(v, Path), str(v)) for k, v in ctx.inputs.items()},
        "work_dir": str(ctx.work_dir), "checkpoint_dir": str(ctx.checkpoint_dir), "seed": ctx.seed,
        "plugins": plugin_recipe(ctx.plugins), "threads": threads, "parent": os.getpid(), "world": world,
        "options": ctx.options.as_dict(),
    }


def _exit_with_parent(parent: int) -> None:
    """A child whose pipeline process died stops too: no orphan writing into a stage a rerun owns."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="alignflow-parent-watch", daemon=True).start()


def _run_stage(payload: dict, out, rank: int) -> tuple:
    """Rebuild the context, run the runner; rank 0 sends its metrics as they come. Returns the result's parts."""
    configure_logging()  # the parent's progress lines, in the same format
    if rank:
        logging.getLogger("alignflow").setLevel(logging.WARNING)  # rank 0 speaks for the stage
    import torch  # the CLI imports this module (configure_logging): torch and the runners load in the child only

    from alignflow.flows.stages.runners import RUNNERS

    torch.set_num_threads(payload["threads"])
    plugins = get_plugins()
    for path, name, dist, version in payload["plugins"]:
        plugins.add(_resolve(path), name, dist, version)
    ctx = StageContext(
        name=payload["name"], spec=StageSpec.model_validate(payload["spec"]),
        settings=settings_model(payload["kind"]).model_validate(payload["settings"]),
        inputs={k: Path(v) if is_path else v for k, (is_path, v) in payload["inputs"].items()},
        work_dir=Path(payload["work_dir"]), checkpoint_dir=Path(payload["checkpoint_dir"]),
        seed=payload["seed"], plugins=plugins, world=payload["world"],
        options=RunOptions.from_dict(payload["options"]),
        log_metrics=(lambda metrics, step: out.put(("metrics", metrics, step))) if rank == 0 else _ignore,
    )
    result = RUNNERS[payload["kind"]](ctx)
    return {k: str(v) for k, v in result.outputs.items()}, result.metrics, result.headline, result.fingerprint


def _portable(exc: BaseException) -> tuple:
    """(the exception when it pickles, so the parent raises what the runner raised, else None;
    its traceback; whether it is a lost connection to the other ranks rather than a cause)."""
    lost_peers = _lost_peers(exc)
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:
        exc = None
    return exc, traceback.format_exc(), lost_peers


# What a collective raises when another rank died: gloo's and NCCL's errors are plain RuntimeErrors.
_PEER_LOSS = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "NCCL communicator was aborted",
              "remote process exited")


def _lost_peers(exc: BaseException) -> bool:
    """Whether `exc` is a rank losing its connection to the others rather than a failure of its own."""
    import torch.distributed as dist

    return isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and any(s in str(exc) for s in _PEER_LOSS))


def _child_main(payload: dict, out: multiprocessing.Queue) -> None:
    """The one-process child: run the stage, report metrics and the result or the error."""
    try:
        _exit_with_parent(payload["parent"])
        own_group.drop()  # the parent's one-process group is not ours: torch would join it
        out.put(("result", 0, *_run_stage(payload, out, 0)))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        out.put(("error", 0, *_portable(exc)))


def rank_main(payload: dict, out: multiprocessing.Queue) -> None:
    """One rank, started by torch's elastic launcher (RANK, WORLD_SIZE, MASTER_ADDR/PORT are its)."""
    own_group.drop()  # a mark inherited from a parent with its own group: RANK etc. are the launcher's here
    rank = int(os.environ["RANK"])
    out.put(("started", rank, os.getpid()))
    try:
        _exit_with_parent(payload["parent"])
        if int(os.environ["WORLD_SIZE"]) != payload["world"]:
            raise AlignflowError(f"stage {payload['name']!r}: this node expected {payload['world']} ranks in all and "
                                 f"the rendezvous formed {os.environ['WORLD_SIZE']}: start every node with the "
                                 "same --nproc")
        outputs = _run_stage(payload, out, rank)
        if rank == 0:
            out.put(("result", rank, *outputs))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        out.put(("error", rank, *_portable(exc)))
        out.close()
        out.join_thread()  # in the pipe before this process dies and its peers fail for want of it
        raise  # the launcher sees the rank fail and stops the others


def _ignore(metrics, step) -> None:
    """Ranks other than 0 log nothing: rank 0's metrics are the stage's."""


def run_in_child(kind: str, ctx: StageContext, threads: int) -> StageResult:
    """Run `RUNNERS[kind](ctx)` in a spawned child with `threads` torch threads; its metrics reach
    `ctx.log_metrics` as they come and its result is returned. Data-parallel ranks: flows/launch/ranks.py."""
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    child = mp.Process(target=_child_main, args=(stage_payload(kind, ctx, threads), out), name=f"alignflow-{ctx.name}")
    child.start()
    try:
        return _collect(ctx, child, out)
    except BaseException:
        child.kill()
        raise
    finally:
        child.join(timeout=30)
        if child.is_alive():
            child.kill()
            child.join()


def _collect(ctx: StageContext, child, out) -> StageResult:
    """Relay the child's metrics until its result; raise its error or its death."""
    while True:
        try:
            message = out.get(timeout=1.0)
        except queue_mod.Empty:
            if not child.is_alive():
                raise ChildFailed(f"stage {ctx.name!r}: the stage's process exited with code {child.exitcode} "
                                  "without a result (killed?)") from None
            continue
        if message[0] == "metrics":
            ctx.log_metrics(message[1], message[2])
        elif message[0] == "error":
            _, _, exc, trace, _ = message
            raise_failure(ctx, exc, trace, "the stage's process")
        else:
            _, _, outputs, metrics, headline, env = message
            return StageResult({k: Path(v) for k, v in outputs.items()}, metrics, headline, env)


def raise_failure(ctx: StageContext, exc: BaseException | None, trace: str, place: str, cause=None):
    """Raise what a child sent: its own exception with `place` and its traceback as a note, else
    ChildFailed carrying the traceback (the exception did not pickle)."""
    if exc is None:
        raise ChildFailed(f"stage {ctx.name!r} failed in {place}:\n{trace.rstrip()}") from cause
    exc.add_note(f"--- in {place}:\n{trace.rstrip()}")
    raise exc
