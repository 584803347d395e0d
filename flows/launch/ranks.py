"""A stage's data-parallel ranks on this node, started by torch's elastic launcher (flows/launch/nodes.py).

The launcher runs in a thread of the pipeline process while this thread relays rank 0's metrics as
they come over a queue every rank holds. A rank that raises sends its exception, then dies; the
launcher (`max_restarts=0`) stops this node's other ranks, and on several nodes the failure is
recorded in node 0's rendezvous store, where every node's gatherer looks for it and stops its own
ranks. The error raised names the rank that failed first in cause: a rank that only lost its peers
(a `torch.distributed.DistError` in a collective) is named only when no rank failed otherwise.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import queue as queue_mod
import signal
import threading
import time
from pathlib import Path

from alignflow.flows.launch.child import ChildFailed, raise_failure, rank_main, run_in_child, stage_payload
from alignflow.flows.launch.nodes import connect, failures, launch_config, publish_failure, rendezvous_id, run_ended
from alignflow.flows.options import Nodes
from alignflow.flows.stages import StageContext, StageResult

CAUSE_WAIT_S = 10.0  # after ranks here lost their peers: how long to wait for another node's report of why


def run_in_processes(kind: str, ctx: StageContext, threads: int, ranks: int = 1,
                     nodes: Nodes | None = None) -> StageResult | None:
    """`run_ranks` for more than one rank (or on several nodes), else `run_in_child`: one spawned process."""
    if ranks > 1 or (nodes is not None and nodes.many):
        return run_ranks(kind, ctx, threads, ranks, nodes)
    return run_in_child(kind, ctx, threads)


def run_ranks(kind: str, ctx: StageContext, threads: int, ranks: int, nodes: Nodes | None = None) -> StageResult | None:
    """`RUNNERS[kind](ctx)` on `ranks` processes here, in one process group with the ranks of the other
    `nodes`; rank 0's metrics reach `ctx.log_metrics` as they come and its result is returned (None on
    a node without rank 0)."""
    from torch.distributed.launcher.api import elastic_launch

    nodes = nodes or Nodes()
    run_id = rendezvous_id(ctx)
    out = multiprocessing.get_context("spawn").Queue()
    payload = stage_payload(kind, ctx, threads, world=ranks * nodes.count)
    board = connect(nodes) if nodes.many else None
    ended, outcome = threading.Event(), {}

    def launch() -> None:
        try:
            with launch_config(run_id, ranks, nodes) as config:
                elastic_launch(config, rank_main)(payload, out)
        except BaseException as exc:  # noqa: BLE001 - the gatherer raises it
            outcome["error"] = exc
        finally:
            ended.set()

    _quiet_launcher_logs()
    gather = _Gather(ctx, nodes, run_id, out, board)
    threading.Thread(target=launch, name=f"alignflow-{ctx.name}-launcher", daemon=True).start()
    try:
        gather.until(ended)
    except BaseException:
        gather.stop_ranks()  # interrupted here: no rank keeps training into a stage a rerun owns
        ended.wait(60)
        raise
    return gather.result_or_raise(outcome.get("error"))


def _quiet_launcher_logs() -> None:
    """The launcher logs each failure with its traceback; the error raised here carries it already."""
    for name in ("torch.distributed.elastic", "torch.distributed.launcher"):
        logging.getLogger(name).setLevel(logging.CRITICAL)


class _Gather:
    """What this node's ranks send: pids, rank 0's metrics and result, errors; and other nodes' failures."""

    def __init__(self, ctx: StageContext, nodes: Nodes, run_id: str, out, board):
        self.ctx, self.nodes, self.run_id, self.out, self.board = ctx, nodes, run_id, out, board
        self.pids: dict[int, int] = {}
        self.errors: list[tuple] = []  # (rank, exception or None, traceback, lost_peers)
        self.result: StageResult | None = None
        self.stopped = False  # this node's ranks were stopped for another node's failure
        self.abandoned = False  # node 0's run ended before this node's ranks started

    def place(self, rank: int) -> str:
        return f"the stage's rank {rank} process" + (f" on node {self.nodes.rank}" if self.nodes.many else "")

    def until(self, ended: threading.Event) -> None:
        while True:
            try:
                message = self.out.get(timeout=0.5)
            except queue_mod.Empty:
                if ended.is_set():
                    return  # every rank has exited, so all it sent was in the pipe
                # another node's failure stops these ranks only when it is a cause, not a rank that merely
                # lost its peers: that may be a peer of a rank here that died, which this node's launcher
                # reports itself (and names) a moment later
                if self.board is not None and not self.stopped and self._remote(causes_only=True):
                    self.stop_ranks()
                    self.stopped = True
                if self.board is not None and not self.pids and run_ended(self.board):
                    self.abandoned = True  # node 0 will not join: leave the launcher waiting in vain
                    return
                continue
            kind = message[0]
            if kind == "started":
                self.pids[message[1]] = message[2]
            elif kind == "metrics" and not self.errors:
                self.ctx.log_metrics(message[1], message[2])
            elif kind == "error":
                self.errors.append(message[1:])
                self._publish(message[1], f"{type(message[2]).__name__ if message[2] else 'an error'}: "
                                          f"{message[2] if message[2] else message[3].strip().splitlines()[-1]}",
                              message[4])
            elif kind == "result":
                _, _, outputs, metrics, headline, env = message
                self.result = StageResult({k: Path(v) for k, v in outputs.items()}, metrics, headline, env)

    def stop_ranks(self) -> None:
        for pid in self.pids.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def _publish(self, rank: int, what: str, lost_peers: bool) -> None:
        if self.board is not None:
            publish_failure(self.board, self.run_id, {"rank": rank, "node": self.nodes.rank, "lost_peers": lost_peers,
                                                      "text": f"rank {rank} on node {self.nodes.rank} failed: {what}"})

    def _remote(self, causes_only: bool = False) -> list[dict]:
        try:
            found = [f for f in failures(self.board, self.run_id) if f["node"] != self.nodes.rank]
        except Exception:  # node 0's store is gone with its run: its ranks are gone too
            found = [{"node": 0, "lost_peers": False, "text": f"node 0's rendezvous store at {self.nodes.endpoint} "
                                                              "is gone (its run ended or died)"}]
        return [f for f in found if not (causes_only and f["lost_peers"])]

    def result_or_raise(self, launcher_error: BaseException | None) -> StageResult | None:
        """Rank 0's result when every rank finished; else the clearest error of the failure."""
        if self.abandoned:
            raise ChildFailed(f"stage {self.ctx.name!r}: node 0's run ended before the stage's ranks met (it "
                              "failed, or was finished, there): see node 0's output")
        deaths = self._deaths(launcher_error)
        for rank, exc, trace, lost_peers in self.errors:
            if not lost_peers:
                raise_failure(self.ctx, exc, trace, self.place(rank), launcher_error)
        if deaths and not self.stopped:
            raise ChildFailed(f"stage {self.ctx.name!r}: " + "; ".join(deaths)) from launcher_error
        remote = self._remote_causes() if self.board is not None else []
        if remote:
            raise ChildFailed(f"stage {self.ctx.name!r}: {remote[0]['text']}; this node's ranks were stopped") \
                from launcher_error
        for rank, exc, trace, _ in self.errors:
            raise_failure(self.ctx, exc, trace, self.place(rank), launcher_error)
        if launcher_error is not None:
            raise ChildFailed(f"stage {self.ctx.name!r}: the ranks' launcher failed: {_describe(launcher_error)}") \
                from launcher_error
        if self.result is None and self.nodes.rank == 0:
            raise ChildFailed(f"stage {self.ctx.name!r}: rank 0 ended without a result")
        return self.result

    def _deaths(self, launcher_error: BaseException | None) -> list[str]:
        """Ranks that died without sending an error (killed), from the launcher's ChildFailedError."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        if not isinstance(launcher_error, ChildFailedError) or self.stopped:
            return []  # (stopped: the deaths are this node's own doing)
        said = {rank for rank, *_ in self.errors}
        deaths = []
        for rank, failure in sorted(launcher_error.failures.items()):
            if rank in said:
                continue
            signal_name = f" ({failure.signal_name()})" if failure.exitcode < 0 else ""
            deaths.append(f"{self.place(rank)} exited with code {failure.exitcode}{signal_name} without a result "
                          "(killed?)")
            self._publish(rank, f"exited with code {failure.exitcode}{signal_name} (killed?)", False)
        return deaths

    def _remote_causes(self) -> list[dict]:
        """Another node's failure that caused this one: wait a little for it when ranks here only lost peers."""
        deadline = time.monotonic() + (CAUSE_WAIT_S if self.errors or self.stopped else 0.0)
        while True:
            causes = self._remote(causes_only=True)
            if causes or time.monotonic() >= deadline:
                return causes or self._remote()
            time.sleep(0.2)


def _describe(exc: BaseException) -> str:
    """A launcher error in a line; a rendezvous that timed out says which nodes it waited for."""
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    if isinstance(exc, RendezvousTimeoutError):
        return f"the other nodes did not join its rendezvous in time ({exc})"
    return f"{type(exc).__name__}: {exc}"
