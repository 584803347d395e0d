"""Run options: one frozen object, read once from flags and environment where a run starts.

`alignflow run` (flows/cli_run.py) and the Python API (flows/api.py) build it with `RunOptions.from_env`,
the one place that reads the ALIGNFLOW_* variables; everything below gets it as an argument, and a
stage's processes get the values they need in their payload. Flags override variables.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from alignflow.core.errors import SpecError

NPROC_ENV = "ALIGNFLOW_NPROC"
PARALLEL_ENV = "ALIGNFLOW_PARALLEL_STAGES"
NNODES_ENV = "ALIGNFLOW_NNODES"
NODE_RANK_ENV = "ALIGNFLOW_NODE_RANK"
RDZV_ENDPOINT_ENV = "ALIGNFLOW_RDZV_ENDPOINT"
POOL_TIMEOUT_ENV = "ALIGNFLOW_POOL_TIMEOUT"
CACHE_ENV = "ALIGNFLOW_CACHE"
LOCK_ENV = "ALIGNFLOW_ARTIFACT_LOCK"  # lease (default) | none: the user vouches for one writer at a time
LEASE_ENV = "ALIGNFLOW_LOCK_LEASE_S"
LOCKINGS = ("lease", "none")
AUTO_ASYNC_ENV = "ALIGNFLOW_AUTO_OVERLAP"  # "false": `async_rollouts: auto` stays off (the test suite pins it)
AUTO_PRECISION_ENV = "ALIGNFLOW_AUTO_PRECISION"  # fp32 | bf16-mixed: what `precision: auto` becomes (the suite: fp32)
# `alignflow reproduce` in another environment: |recorded - now| <= REPRODUCE_TOLERANCE x max(1, |recorded|), 0.05
# absolute for an accuracy or a small loss, 5% of a larger value. Measured across CPU kinds (AVX2 against
# AVX-512, the same versions): r1-tiny's metrics moved by up to 0.032 (eval accuracy 0.258 against 0.290).
# Here, not in flows/reproduce.py, so the command line's parser reads it without importing MLflow and Prefect.
REPRODUCE_TOLERANCE = 0.05


def stage_count(text: str, where: str, what: str = "stages") -> int:
    """A number of stages (or `what`), at least 1, from `text`; else a SpecError naming `where`."""
    return _whole(text, where, 1, f" of {what}")


@dataclass(frozen=True)
class Nodes:
    """How many nodes run a stage's ranks, which one this is, and node 0's rendezvous endpoint."""

    count: int = 1  # machines that run each stage's ranks together (`--nnodes`)
    rank: int = 0  # this machine's place, 0 to count - 1; node 0 runs the pipeline (`--node-rank`)
    host: str = "127.0.0.1"  # node 0's address, where the nodes meet (`--rdzv-endpoint`)
    port: int = 0  # one node: a free port per stage

    @property
    def many(self) -> bool:
        return self.count > 1

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"


def parse_nodes(nnodes: str | None, node_rank: str | None, endpoint: str | None,
                names: tuple[str, str, str] = (NNODES_ENV, NODE_RANK_ENV, RDZV_ENDPOINT_ENV)) -> Nodes:
    """Nodes from their text; a SpecError names the flag (or variable, `names`) at fault."""
    n_name, rank_name, endpoint_name = names
    count = _whole(nnodes or "1", n_name, 1)
    rank = _whole(node_rank or "0", rank_name, 0)
    if rank >= count:
        raise SpecError(f"{rank_name}={rank}: must be below {n_name}={count} (node ranks are 0 to {count - 1})")
    if count == 1:
        return Nodes()
    if not endpoint:
        raise SpecError(f"{n_name}={count} needs {endpoint_name}=HOST:PORT, node 0's address and a free port "
                        "on it, the same on every node")
    host, sep, port = endpoint.strip().rpartition(":")
    host = host.strip("[]")  # [::1]:29400
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise SpecError(f"{endpoint_name}={endpoint!r}: expected HOST:PORT (node 0's address and a free port "
                        "on it, e.g. 10.0.0.1:29400)")
    return Nodes(count, rank, host, int(port))


def _whole(text: str, name: str, least: int, of: str = "") -> int:
    if not text.isdigit() or int(text) < least:
        raise SpecError(f"{name}={text!r}: expected a whole number{of}, at least {least}")
    return int(text)


@dataclass(frozen=True)
class RunOptions:
    """How a run uses this machine (and others): processes, concurrent stages, nodes, pools, the store."""

    nproc: int = 1  # data-parallel processes per node for each data-parallel stage (`--nproc`)
    parallel: int | None = None  # training stages at once (`--parallel`); None: one per 8 CPU cores
    nodes: Nodes = field(default_factory=Nodes)  # `--nnodes/--node-rank/--rdzv-endpoint`
    pool_timeout_s: int = 600  # how long a stage waits for a worker of its work pool
    cache: str | None = None  # local cache of a URL artifacts root; None: ~/.cache/alignflow of the machine
    artifact_lock: str = "lease"  # lease | none (one writer at a time, vouched for by the user)
    lock_lease_s: float = 120.0  # how long a dead run's stage lock outlives its last heartbeat
    auto_async: bool = True  # whether `async_rollouts: auto` may turn asynchronous rollouts on
    auto_precision: str | None = None  # what `precision: auto` becomes, fp32 | bf16-mixed; None: the hardware decides

    def __post_init__(self):
        if self.artifact_lock not in LOCKINGS:
            raise SpecError(f"{LOCK_ENV}={self.artifact_lock!r}: expected 'lease' or 'none'")
        if self.auto_precision not in (None, "fp32", "bf16-mixed"):
            raise SpecError(f"{AUTO_PRECISION_ENV}={self.auto_precision!r}: expected fp32 or bf16-mixed")

    @property
    def parallel_stages(self) -> int:
        """Training stages that may run at once: `parallel`, else one per 8 CPU cores (each uses every
        core it is given: two on a 2-core box run slower than one after the other)."""
        return self.parallel if self.parallel is not None else max(1, (os.cpu_count() or 1) // 8)

    @property
    def total_processes(self) -> int:
        """The ranks of every node together: `nproc` on each of the nodes."""
        return self.nproc * self.nodes.count

    def as_dict(self) -> dict:
        """Plain data (JSON), for a flow run's parameters or a child's payload."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping | None) -> RunOptions:
        """Back from `as_dict()`; None gives the defaults."""
        data = dict(data or {})
        if isinstance(data.get("nodes"), Mapping):
            data["nodes"] = Nodes(**data["nodes"])
        return cls(**data)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, *, nproc: int | None = None,
                 parallel: int | None = None, nnodes: str | None = None, node_rank: str | None = None,
                 rdzv_endpoint: str | None = None) -> RunOptions:
        """The options of the ALIGNFLOW_* variables of `environ` (else this process's environment), each
        overridden by its flag when given; an error names the flag or the variable at fault."""
        env = os.environ if environ is None else environ
        nodes_given = [(nnodes, "--nnodes", NNODES_ENV), (node_rank, "--node-rank", NODE_RANK_ENV),
                       (rdzv_endpoint, "--rdzv-endpoint", RDZV_ENDPOINT_ENV)]
        texts = [flag if flag is not None else env.get(var) for flag, _, var in nodes_given]
        # an error names what the user gave: the variable when it was set and the flag not, else the flag
        names = tuple(var if flag is None and env.get(var) is not None else name for flag, name, var in nodes_given)
        lease = env.get(LEASE_ENV)
        return cls(
            nproc=nproc if nproc is not None else _count(env, NPROC_ENV, "processes", 1),
            parallel=parallel if parallel is not None else _count(env, PARALLEL_ENV, "stages", None),
            nodes=parse_nodes(*texts, names=names),
            pool_timeout_s=_count(env, POOL_TIMEOUT_ENV, "seconds", 600),
            cache=env.get(CACHE_ENV) or (str(Path(env["XDG_CACHE_HOME"]) / "alignflow") if env.get("XDG_CACHE_HOME")
                                         else None),
            artifact_lock=env.get(LOCK_ENV, "lease"),
            lock_lease_s=cls.lock_lease_s if lease is None else _seconds(lease),
            auto_async=env.get(AUTO_ASYNC_ENV, "").lower() not in ("0", "false", "off"),
            auto_precision=env.get(AUTO_PRECISION_ENV) or None,
        )


def _count(env: Mapping[str, str], var: str, what: str, default):
    text = env.get(var)
    return default if text is None else stage_count(text, var, what)


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise SpecError(f"{LEASE_ENV}={text!r}: expected a number of seconds above 0")
    return value
