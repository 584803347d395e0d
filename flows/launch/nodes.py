"""Where a data-parallel stage's ranks run: `--nproc` processes on this machine, on one node or several.

Every node's ranks are started by torch's elastic launcher (`torch.distributed.launcher.api.elastic_launch`,
the engine behind torchrun) after a c10d rendezvous, with `max_restarts=0`: a rank that fails stops its
node's ranks, and the failure reaches the other nodes through the rendezvous store (`publish_failure`).

One node: the rendezvous store is on 127.0.0.1 and a free port, one per stage. Several nodes
(`--nnodes N --node-rank K --rdzv-endpoint HOST:PORT`): node 0's pipeline process hosts one store at
HOST:PORT for its whole run (`hosting`), every stage's launcher on every node is its client, and a
stage's rendezvous is told apart by its run id (`rendezvous_id`: the stage's digest). One long-lived
store, rather than one per stage on the same port, lets stages run concurrently and one end while the
next begins without a fight over the port, and keeps each rank's error readable after its node's
launcher has gone. The workers' process group still gets a fresh store per stage (c10d's bootstrap
store, hosted by the node that c10d ranks first), so no key of one stage's group reaches the next.

c10d ranks the nodes by sorting their descriptors (FQDN, pid), not by `--node-rank`; our backend
(`NodeRankRendezvous`, registered as `alignflow-c10d`) keeps c10d's rendezvous and gives each node the
group rank it was started with, so node K holds global ranks K*nproc .. K*nproc+nproc-1 and global
rank 0, the one that reports metrics and returns the result, is on node 0, which owns the artifact.
torch's `static` backend also honours the node rank, but it hands the workers the rendezvous store
itself: with one store for a run, one stage's process-group keys would meet the next stage's.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Iterator

from alignflow.core.errors import SpecError
from alignflow.core.servers import free_port
from alignflow.flows.options import Nodes

log = logging.getLogger(__name__)

BACKEND = "alignflow-c10d"
# How long node 0 waits for the other nodes to join a stage (torchrun's default), and how long another
# node waits in a stage's rendezvous for node 0, which may be busy with stages it runs alone.
JOIN_TIMEOUT_S = 900
FOLLOWER_JOIN_TIMEOUT_S = 7 * 24 * 3600
STORE_TIMEOUT_S = 600  # a client's connection to node 0's store, and each blocking read of it
_ENDED = "alignflow/run-ended"


# What DeepSpeed's launcher (`deepspeed`, deepspeed.launcher.launch) sets in each process it starts: the host's
# place among the hosts (CROSS_RANK of CROSS_SIZE), its processes (LOCAL_SIZE), the process's LOCAL_RANK, and
# MASTER_ADDR:MASTER_PORT, where its process group would meet.
DEEPSPEED_LAUNCHER = ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
LAUNCHER_VARS = (*DEEPSPEED_LAUNCHER, "RANK", "WORLD_SIZE")


@dataclass(frozen=True)
class Launched:
    """A process DeepSpeed's launcher started: one of `nproc` on host `node` of `nodes`, local rank `local_rank`.

    alignflow starts a stage's ranks itself, one rendezvous per stage, so a launcher's processes map onto
    nodes: local rank 0 of each host is that host's `alignflow run --nnodes nodes --node-rank node --nproc
    nproc --rdzv-endpoint endpoint`, and the host's other processes have nothing to do and exit.
    """

    nodes: int
    node: int
    nproc: int
    local_rank: int
    endpoint: str


def launched_by_deepspeed(environ) -> Launched | None:
    """The place DeepSpeed's launcher gave the process of `environ`, or None when it did not start it."""
    if not all(var in environ for var in DEEPSPEED_LAUNCHER):
        return None
    values = {var: environ[var] for var in DEEPSPEED_LAUNCHER}
    bad = [f"{k}={v!r}" for k, v in values.items() if k not in ("MASTER_ADDR", "MASTER_PORT") and not v.isdigit()]
    if bad:
        raise SpecError(f"started by DeepSpeed's launcher, but {', '.join(bad)}: expected whole numbers")
    return Launched(int(values["CROSS_SIZE"]), int(values["CROSS_RANK"]), int(values["LOCAL_SIZE"]),
                    int(values["LOCAL_RANK"]), f"{values['MASTER_ADDR']}:{values['MASTER_PORT']}")


def rendezvous_id(ctx) -> str:
    """A stage's rendezvous run id, the same on every node: its name and digest (the name of its
    artifact folder, `<root>/<stage>/<digest>/`, whatever path the shared root is mounted at)."""
    return f"alignflow-{ctx.name}-{Path(ctx.checkpoint_dir).parent.name}"


# --- the rendezvous backend -------------------------------------------------------------------------


def _node_rank_handler(params):
    from torch.distributed.elastic.rendezvous.registry import _create_c10d_handler

    return NodeRankRendezvous(_create_c10d_handler(params), int(params.config["node_rank"]))


def register_backend() -> None:
    """Make `alignflow-c10d` a rendezvous backend of torch's registry (registering twice is allowed)."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, _node_rank_handler)


class NodeRankRendezvous:
    """c10d's dynamic rendezvous, with each node's group rank set to its `--node-rank` (a torch
    `RendezvousHandler` by its methods: the class is not imported here, so the CLI loads no torch)."""

    def __init__(self, c10d, node_rank: int):
        self._c10d, self._node_rank = c10d, node_rank

    def next_rendezvous(self):
        from torch.distributed.elastic.rendezvous import RendezvousError, RendezvousInfo

        info = self._c10d.next_rendezvous()
        # every node adds 1 to its own key; two nodes with one rank would take each other's workers' ranks
        if info.store.add(f"alignflow/node-rank/{self._node_rank}", 1) > 1:
            raise RendezvousError(f"two nodes joined stage rendezvous {self.get_run_id()!r} with node rank "
                                  f"{self._node_rank}: give each node its own --node-rank")
        return RendezvousInfo(info.store, self._node_rank, info.world_size, info.bootstrap_store_info)

    @property
    def use_agent_store(self) -> bool:
        return self._c10d.use_agent_store

    def get_backend(self) -> str:
        return BACKEND

    def is_closed(self) -> bool:
        return self._c10d.is_closed()

    def set_closed(self) -> None:
        self._c10d.set_closed()

    def num_nodes_waiting(self) -> int:
        return self._c10d.num_nodes_waiting()

    def get_run_id(self) -> str:
        return self._c10d.get_run_id()

    def shutdown(self) -> bool:
        return self._c10d.shutdown()


@contextlib.contextmanager
def launch_config(run_id: str, local_ranks: int, nodes: Nodes) -> Iterator:
    """torch's LaunchConfig for one stage's ranks on this node; its log folder is removed after."""
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.launcher.api import LaunchConfig

    register_backend()
    loopback = nodes.host in ("127.0.0.1", "localhost", "::1")
    endpoint = nodes.endpoint if nodes.many else f"127.0.0.1:{free_port()}"
    timeout = JOIN_TIMEOUT_S if nodes.rank == 0 else FOLLOWER_JOIN_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="alignflow-ranks-") as logs:
        yield LaunchConfig(
            min_nodes=nodes.count, max_nodes=nodes.count, nproc_per_node=local_ranks, run_id=run_id,
            rdzv_backend=BACKEND, rdzv_endpoint=endpoint, max_restarts=0, start_method="spawn",
            # several nodes: node 0's pipeline process hosts the store (`hosting`), every launcher is a client
            rdzv_configs={"node_rank": nodes.rank, "is_host": not nodes.many, "timeout": timeout,
                          "read_timeout": STORE_TIMEOUT_S},
            local_addr="127.0.0.1" if loopback else None,  # else this machine's FQDN, as torchrun
            logs_specs=DefaultLogsSpecs(log_dir=logs),
        )


# --- node 0's store: failures and the end of the run ------------------------------------------------


def connect(nodes: Nodes, host: bool = False):
    """A client of node 0's rendezvous store (it waits up to STORE_TIMEOUT_S for node 0), or the server."""
    from torch.distributed import TCPStore

    # the server connects to itself too: at an address not of this machine it fails, after 30 s
    return TCPStore(nodes.host, nodes.port, is_master=host, multi_tenant=True, wait_for_workers=False,
                    timeout=timedelta(seconds=30 if host else STORE_TIMEOUT_S))


@contextlib.contextmanager
def hosting(nodes: Nodes) -> Iterator[None]:
    """On node 0 of several: serve the rendezvous store for the run; at its end tell the other nodes."""
    if not (nodes.many and nodes.rank == 0):
        yield
        return
    try:
        store = connect(nodes, host=True)
    except Exception as exc:
        raise SpecError(f"--rdzv-endpoint {nodes.endpoint}: node 0 cannot serve the rendezvous there "
                        f"({type(exc).__name__}: {exc}); give an address of this machine and a free port") from None
    log.info("node 0 of %d: rendezvous store at %s", nodes.count, nodes.endpoint)
    try:
        yield
    finally:
        store.set(_ENDED, "1")


def run_ended(store) -> bool:
    """Whether node 0's pipeline run has ended (its store says so, or is gone with it)."""
    try:
        return store.check([_ENDED])
    except Exception:
        return True


def publish_failure(store, run_id: str, failure: dict) -> None:
    """Record one rank's failure for the other nodes: {rank, node, text, lost_peers}."""
    index = store.add(f"alignflow/{run_id}/failures", 1)
    store.set(f"alignflow/{run_id}/failure/{index}", json.dumps(failure))


def failures(store, run_id: str) -> list[dict]:
    """The failures every node recorded for one stage's rendezvous, in the order they were recorded."""
    count = store.add(f"alignflow/{run_id}/failures", 0)
    return [json.loads(store.get(f"alignflow/{run_id}/failure/{i}")) for i in range(1, count + 1)]
