"""Run a stage's runner in a child process, so independent training stages of one pipeline overlap.

Training runners own process-wide state: torch's global RNG (they seed it), DeepSpeed's process
group, transformers' lazy imports. Two of them in threads of one process corrupt each other, so the
pipeline runs the first training stage in its own process and any stage that would have to wait for
it in a fresh child (`spawn`: no inherited locks or threads). The child rebuilds the stage context
from plain data, sends its step metrics back as they come (the parent logs them to MLflow) and
ends with the result or the error. A stage gives the same result in either place: same seed, same
code, and the same share of torch threads (flows/execute.py gives both the same). A child stops
when the pipeline's process dies, so no orphan keeps writing into a stage that a rerun resumes.

With `ranks > 1` the stage runs data-parallel: one child per rank in one process group (as torchrun
would start them: RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), rank 0 reporting metrics and the
result, and every rank's error reaching the parent.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pickle
import queue as queue_mod
import threading
import time
import traceback
import types
from pathlib import Path
from typing import Any

from alignflow.core.errors import AlignflowError
from alignflow.flows.stages import StageContext, StageResult

# Variables `core.engine.init_distributed` sets when it forms a one-process group itself.
_OWN_GROUP_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
OWN_GROUP_MARK = "ALIGNFLOW_OWN_PROCESS_GROUP"


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
    from alignflow.core.plugins import entry_point_names

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
    launched = "RANK" in os.environ and OWN_GROUP_MARK not in os.environ
    return not launched and plugin_recipe(plugins) is not None


def _payload(kind: str, ctx: StageContext, threads: int, rank_env: dict[str, str]) -> dict:
    return {
        "rank_env": rank_env, "kind": kind, "name": ctx.name, "spec": ctx.spec.model_dump(mode="json", by_alias=True),
        "settings": ctx.settings.model_dump(mode="json", by_alias=True),
        "inputs": {k: (isinstance(v, Path), str(v)) for k, v in ctx.inputs.items()},
        "work_dir": str(ctx.work_dir), "checkpoint_dir": str(ctx.checkpoint_dir), "seed": ctx.seed,
        "plugins": plugin_recipe(ctx.plugins), "threads": threads, "parent": os.getpid(),
    }


def _exit_with_parent(parent: int) -> None:
    """A child whose pipeline process died stops too: no orphan writing into a stage a rerun owns."""
    def watch():
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="alignflow-parent-watch", daemon=True).start()


def _child_main(payload: dict, out: multiprocessing.Queue) -> None:
    """The child: rebuild the context, run the runner, report metrics and the result or the error."""
    try:
        _exit_with_parent(payload["parent"])
        if os.environ.pop(OWN_GROUP_MARK, None):  # the parent's one-process group is not ours
            for var in _OWN_GROUP_VARS:
                os.environ.pop(var, None)
        os.environ.update(payload["rank_env"])
        rank = int(payload["rank_env"].get("RANK", 0))
        from alignflow.flows.cli import configure_logging

        configure_logging()  # the parent's progress lines, in the same format
        if rank:
            import logging

            logging.getLogger("alignflow").setLevel(logging.WARNING)  # rank 0 speaks for the stage
        import torch

        from alignflow.core.plugins import get_plugins
        from alignflow.core.settings import settings_model
        from alignflow.core.spec import StageSpec
        from alignflow.flows.stages.registry import RUNNERS

        torch.set_num_threads(payload["threads"])
        plugins = get_plugins()
        for path, name, dist, version in payload["plugins"]:
            plugins.add(_resolve(path), name, dist, version)
        ctx = StageContext(
            name=payload["name"], spec=StageSpec.model_validate(payload["spec"]),
            settings=settings_model(payload["kind"]).model_validate(payload["settings"]),
            inputs={k: Path(v) if is_path else v for k, (is_path, v) in payload["inputs"].items()},
            work_dir=Path(payload["work_dir"]), checkpoint_dir=Path(payload["checkpoint_dir"]),
            seed=payload["seed"], plugins=plugins,
            log_metrics=(lambda metrics, step: out.put(("metrics", metrics, step))) if rank == 0 else _ignore,
        )
        result = RUNNERS[payload["kind"]](ctx)
        out.put(("result", rank, {k: str(v) for k, v in result.outputs.items()}, result.metrics, result.headline))
    except BaseException as exc:  # noqa: BLE001 - everything must reach the parent
        try:  # the exception itself when it pickles, so the parent raises what the runner raised
            pickle.loads(pickle.dumps(exc))
        except Exception:
            exc = None
        out.put(("error", rank, exc, traceback.format_exc()))


def _ignore(metrics, step) -> None:
    """Ranks other than 0 log nothing: rank 0's metrics are the stage's."""


def _rank_envs(ranks: int) -> list[dict[str, str]]:
    """Each rank's process-group variables, as torchrun sets them; none for a single process."""
    if ranks == 1:
        return [{}]
    from alignflow.core.engine import free_port

    shared = {"WORLD_SIZE": str(ranks), "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": str(free_port())}
    return [{**shared, "RANK": str(rank), "LOCAL_RANK": str(rank)} for rank in range(ranks)]


def run_in_child(kind: str, ctx: StageContext, threads: int, ranks: int = 1) -> StageResult:
    """Run `RUNNERS[kind](ctx)` in spawned children, `ranks` of them data-parallel, each with `threads`
    torch threads; rank 0's metrics reach `ctx.log_metrics` as they come and its result is returned."""
    mp = multiprocessing.get_context("spawn")
    out = mp.Queue()
    children = [mp.Process(target=_child_main, args=(_payload(kind, ctx, threads, env), out),
                           name=f"alignflow-{ctx.name}" + (f"-rank{rank}" if ranks > 1 else ""))
                for rank, env in enumerate(_rank_envs(ranks))]
    for child in children:
        child.start()
    try:
        return _collect(ctx, children, out)
    except BaseException:
        for child in children:  # a failed rank leaves the others waiting in a collective
            child.kill()
        raise
    finally:
        for child in children:
            child.join(timeout=30)
            if child.is_alive():
                child.kill()
                child.join()


def _collect(ctx: StageContext, children: list, out) -> StageResult:
    """Relay rank 0's metrics until every rank has its result; raise the first error or death."""
    ranks, finished, result = len(children), set(), None

    def place(rank: int) -> str:
        return f"the stage's rank {rank} process" if ranks > 1 else "the stage's process"

    while len(finished) < ranks:
        try:
            message = out.get(timeout=1.0)
        except queue_mod.Empty:
            for rank, child in enumerate(children):
                if rank not in finished and not child.is_alive():
                    raise ChildFailed(f"stage {ctx.name!r}: {place(rank)} exited with code {child.exitcode} "
                                      "without a result (killed?)") from None
            continue
        if message[0] == "metrics":
            ctx.log_metrics(message[1], message[2])
        elif message[0] == "error":
            _, rank, exc, trace = message
            if exc is None:
                raise ChildFailed(f"stage {ctx.name!r} failed in {place(rank)}:\n{trace.rstrip()}")
            exc.add_note(f"--- in {place(rank)}:\n{trace.rstrip()}")
            raise exc
        else:
            _, rank, outputs, metrics, headline = message
            finished.add(rank)
            if rank == 0:
                result = StageResult({k: Path(v) for k, v in outputs.items()}, metrics, headline)
    return result
