"""How a run ends when it is stopped: nothing left running, nothing left RUNNING.

- SIGINT / SIGTERM (`RunGuard.install_handlers`): the run's child processes (ranks, stage children, engines)
  get SIGTERM, then SIGKILL after a grace period; the unfinished flow runs of its stages on work pools
  (found by their `pipeline_run_tag`) are set Cancelling, so their workers stop them (Prefect's own
  cancellation: the worker SIGTERMs the flow run's process group, then SIGKILLs it after 30 s, and sets
  it Cancelled), and each is reported once Cancelled or after `CANCEL_WAIT_S`; the MLflow runs it opened
  are closed KILLED; its Prefect flow run and running task runs are set Crashed; Prefect's temporary
  server is stopped; the process exits 128 + the signal. Checkpoints are written atomically, so the
  rerun resumes.
- SIGKILL, which no handler sees (`start_watchdog`): a small process watches the run's process tree
  and, when the run is gone, stops what it left (Prefect's temporary server, ranks).
- A run that died either way leaves its MLflow runs RUNNING; the next run in the project closes
  those whose process is gone (`close_dead_runs`) and sets their Prefect flow run Crashed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from alignflow.flows.store.lease import release_held

log = logging.getLogger(__name__)

GRACE_S = 5.0
# How long a stopped run waits for its stages' flow runs on work pools to reach Cancelled. The worker
# SIGTERMs the flow run's process group, checks every 3 s that it is gone (SIGKILL after 30 s), runs the
# flow's cancellation hooks in a fresh process, then sets Cancelled: seconds for a stage that stops on
# SIGTERM, over 30 s for one that does not. A second Ctrl-C ends the wait at once.
CANCEL_WAIT_S = 60.0


def process_start(pid: int) -> str | None:
    """The live process's start time in clock ticks since boot (with the pid: a process's identity);
    None once it has exited (a zombie included)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[19] if len(fields) > 19 and fields[0] != "Z" else None


def owner_tags() -> dict[str, str]:
    """Tags that let a later run tell whether the process that opened an MLflow run still lives."""
    return {"alignflow.host": socket.gethostname(), "alignflow.pid": str(os.getpid()),
            "alignflow.pid_start": str(process_start(os.getpid()))}


class RunGuard:
    """One pipeline run's stop state, owned by its session: what a SIGINT or SIGTERM stops, cancels and closes."""

    def __init__(self):
        self.open_runs: dict[str, object] = {}  # MLflow run id -> the client that opened it
        self.flow_run_id: str | None = None  # the run's Prefect flow run, set Crashed by a stop
        self.sent_to_pools = False  # set before this run first sends a stage to a work pool
        self.stopping = False  # set as a stop begins: no stage is sent after it
        self.handling = False  # its handlers are installed (by the CLI; a library caller keeps its own)
        self.watchdog: int | None = None  # the watchdog's pid, which a stop spares

    def running_flow(self, flow_run_id: str) -> None:
        """Remember the flow run to set Crashed; take SIGTERM back from Prefect's engine, whose handler
        crashes the flow but then waits for the running stage threads to finish."""
        self.flow_run_id = flow_run_id
        if self.handling:
            self.install_handlers()

    def sending_to_pool(self) -> None:
        """Called before a stage's flow run is created on a work pool (flows/launch/pools.py): a stop then looks
        for this run's flow runs; refused once a stop has begun, so none is created after it looked."""
        if self.stopping:
            raise RuntimeError("the pipeline is stopping: no more stages are sent to work pools")
        self.sent_to_pools = True

    def close_open_runs(self) -> None:
        """Close the MLflow runs this run opened and has not closed: KILLED, tagged killed."""
        for run_id, client in list(self.open_runs.items()):
            try:
                client.set_tag(run_id, "alignflow.status", "killed")
                client.set_terminated(run_id, "KILLED")
                self.open_runs.pop(run_id, None)
            except Exception as exc:  # the store may be locked by a thread that was mid-write
                log.warning("could not close MLflow run %s: %s", run_id, exc)

    def install_handlers(self) -> dict | None:
        """SIGINT and SIGTERM stop the run (main thread only): the handlers they replaced; None off the main thread."""
        try:
            previous = {sig: signal.signal(sig, self.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
        except ValueError:
            return None
        self.handling = True
        return previous

    def stop(self, signum: int, frame) -> None:
        """The handler: stop, cancel and close everything of the run, then exit 128 + the signal."""
        name = signal.Signals(signum).name
        signal.signal(signum, signal.SIG_DFL)  # a second signal ends it at once
        sys.stderr.write(f"\n{name}: stopping the run's processes, closing its runs\n")
        self.stopping = True
        message = f"the pipeline was stopped by {name}"
        cancelling = self._cancel(message)  # first, so the workers stop their stages while this process stops its own
        spared = {s.server_process.pid for s in _prefect_servers()} | {self.watchdog}  # the server: for the states
        stop_processes([p for p in descendants(os.getpid()) if p not in spared])
        release_held()  # its stages' locks on a URL store, once their processes are gone: free now, not in a lease
        self.close_open_runs()
        _await(cancelling)
        _await(self._cancel(message, skip=frozenset(cancelling)))  # one whose creation was under way as the stop began
        if self.flow_run_id is not None:
            try:
                mark_crashed(self.flow_run_id, f"stopped by {name}")
            except Exception as exc:
                log.warning("could not mark flow run %s crashed: %s", self.flow_run_id, exc)
        for server in _prefect_servers():
            server.stop()
        sys.stderr.flush()
        os._exit(128 + signum)

    def _cancel(self, message: str, skip: frozenset[str] = frozenset()) -> dict[str, str]:
        """`cancel_pool_runs` where this run sent stages to work pools; a failure is logged, not raised."""
        try:
            return cancel_pool_runs(self.flow_run_id, message, skip) if self.sent_to_pools else {}
        except Exception as exc:
            log.warning("could not cancel the stages on work pools: %s", exc)
            return {}


def pipeline_run_tag(flow_run_id) -> str:
    """The tag on each flow run a pipeline run sends to a work pool: how a stop finds them all."""
    return f"alignflow.pipeline_run:{flow_run_id}"


def pool_label(stage: str, pool: str | None, name: str, flow_run_id) -> str:
    return f"stage {stage!r} on work pool {pool!r}: flow run {name} ({flow_run_id})"


def cancel_pool_runs(flow_run_id: str | None, message: str, skip: frozenset[str] = frozenset()) -> dict[str, str]:
    """Set the unfinished flow runs on work pools of pipeline run `flow_run_id` Cancelling (as `prefect flow-run
    cancel` does): the worker running one kills its process; one no worker took yet the server sets Cancelled at once.
    They are found by their tag, so a flow run whose creation was under way as the stop began is found
    too (by a second call, after the first ones are waited for). Returns {id: label} of the runs asked."""
    from prefect import get_client
    from prefect.client.schemas.filters import (FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType,
                                                FlowRunFilterTags)
    from prefect.client.schemas.objects import StateType
    from prefect.states import Cancelling

    if flow_run_id is None:
        return {}
    final = [StateType.COMPLETED, StateType.FAILED, StateType.CANCELLED, StateType.CRASHED]
    asked = {}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            tags=FlowRunFilterTags(all_=[pipeline_run_tag(flow_run_id)]),
            state=FlowRunFilterState(type=FlowRunFilterStateType(not_any_=final))))
        for run in runs:
            if str(run.id) in skip:
                continue
            label = pool_label(run.parameters.get("stage", "?"), run.work_pool_name, run.name, run.id)
            try:
                client.set_flow_run_state(run.id, Cancelling(message=message))
                asked[str(run.id)] = label
            except Exception as exc:
                log.warning("could not cancel %s: %s", label, exc)
    return asked


def await_cancelled(asked: dict[str, str], wait_s: float = CANCEL_WAIT_S, poll_s: float = 0.5) -> dict[str, str]:
    """Wait up to `wait_s` for the flow runs `cancel_pool_runs` asked to reach a final state; writes
    one line per run to stderr and returns {id: its state's name, "still ..." when not final}."""
    from uuid import UUID

    from prefect import get_client

    states: dict[str, str] = {}
    deadline = time.monotonic() + wait_s
    with get_client(sync_client=True) as client:
        while True:
            for flow_run_id in asked:
                try:
                    state = client.read_flow_run(UUID(flow_run_id)).state
                except Exception as exc:
                    state, states[flow_run_id] = None, f"unreadable ({exc})"
                if state is not None:
                    states[flow_run_id] = state.name if state.is_final() else f"still {state.name}"
            if not any(s.startswith("still") for s in states.values()) or time.monotonic() > deadline:
                break
            time.sleep(poll_s)
    for flow_run_id, name in states.items():
        tail = f" after {wait_s:.0f} s: its worker kills it" if name.startswith("still") else ""
        sys.stderr.write(f"{asked[flow_run_id]}: {name}{tail}\n")
    return states


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (children first), from one pass over /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def stop_processes(pids: list[int], grace: float = GRACE_S) -> None:
    """SIGTERM each, then SIGKILL what is still there after `grace` seconds."""
    started = {p: process_start(p) for p in pids}
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p, start in started.items():
            if start is not None and process_start(p) == start:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, sig)
        deadline = time.monotonic() + (grace if sig == signal.SIGTERM else 1.0)
        while time.monotonic() < deadline and any(process_start(p) == s for p, s in started.items() if s):
            time.sleep(0.05)


def _prefect_servers() -> list:
    try:
        from prefect.server.api.server import SubprocessASGIServer
    except ImportError:
        return []
    return [s for s in list(SubprocessASGIServer._instances.values()) if getattr(s, "server_process", None)]


def mark_crashed(flow_run_id: str, message: str) -> None:
    """The flow run and its running task runs set Crashed on the Prefect server."""
    from uuid import UUID

    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter
    from prefect.states import Crashed

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id={"any_": [UUID(flow_run_id)]}))
        for run in runs:
            if run.state is not None and run.state.type.value in ("RUNNING", "PENDING"):
                client.set_task_run_state(run.id, Crashed(message=message), force=True)
        client.set_flow_run_state(UUID(flow_run_id), Crashed(message=message), force=True)


def _await(asked: dict[str, str]) -> None:
    try:
        if asked:
            await_cancelled(asked)
    except Exception as exc:
        log.warning("could not follow the cancelled stages: %s", exc)


@contextlib.contextmanager
def guarded():
    """A `RunGuard` with its handlers and the watchdog for the length of one run; both gone after it (a run
    called from Python, as the tests do, leaves the process's own signal handling as it was)."""
    guard = RunGuard()
    previous = guard.install_handlers()
    watchdog = start_watchdog()
    guard.watchdog = watchdog.pid
    try:
        yield guard
    finally:
        watchdog.terminate()
        watchdog.wait()
        guard.handling = False
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


WATCHDOG = r"""
import os, signal, sys, time
pid, start = int(sys.argv[1]), sys.argv[2]
def stat(p):
    try:
        fields = open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19], fields[0]
    except (OSError, IndexError, ValueError):
        return None
def alive(p, s):
    got = stat(p)
    return got is not None and got[1] == s and got[2] != "Z"
known, me = {}, os.getpid()
while alive(pid, start):
    parent = {}
    for e in os.listdir("/proc"):
        if e.isdigit():
            got = stat(e)
            if got:
                parent[int(e)] = got
    for p in parent:
        q = p
        while q in parent and q != pid and q > 1:
            q = parent[q][0]
        if q == pid and p != me:
            known[p] = parent[p][1]
    time.sleep(1.0)
for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 1.0)):
    for p, s in known.items():
        if alive(p, s):
            try:
                os.kill(p, sig)
            except OSError:
                pass
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and any(alive(p, s) for p, s in known.items()):
        time.sleep(0.1)
"""


def start_watchdog() -> subprocess.Popen:
    """A process that outlives this one only to stop what this one leaves running if it is killed."""
    return subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHDOG, str(os.getpid()),
                             str(process_start(os.getpid()))],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def close_dead_runs(client, experiment_id: str) -> list[str]:
    """Close RUNNING MLflow runs of this host whose process is gone (FAILED, tagged crashed), and set
    the Prefect flow run of each such parent run Crashed. Returns the closed run ids."""
    host = socket.gethostname()
    closed_ids = []
    for run in client.search_runs([experiment_id], filter_string="attributes.status = 'RUNNING'",
                                  max_results=1000):
        tags = run.data.tags
        pid = tags.get("alignflow.pid")
        if tags.get("alignflow.host") != host or not (pid or "").isdigit():
            continue
        if process_start(int(pid)) == tags.get("alignflow.pid_start"):
            continue  # still running (another run in this project)
        client.set_tag(run.info.run_id, "alignflow.status", "crashed")
        client.set_terminated(run.info.run_id, "FAILED")
        closed_ids.append(run.info.run_id)
        flow_run_id = tags.get("prefect.flow_run_id")
        if flow_run_id:
            try:
                mark_crashed(flow_run_id, "its process died")
            except Exception as exc:
                log.warning("could not mark flow run %s crashed: %s", flow_run_id, exc)
    if closed_ids:
        log.warning("closed %d MLflow runs left RUNNING by a run that died", len(closed_ids))
    return closed_ids
