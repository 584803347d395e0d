"""The `alignflow` command line."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import sys
from pathlib import Path

from rich.markup import escape

from alignflow.core.errors import AlignflowError
from alignflow.flows.cli_run import cmd_data, cmd_deploy, cmd_reproduce, cmd_run
from alignflow.flows.cli_show import cmd_doctor, cmd_plugins, cmd_validate, err_console
from alignflow.flows.data import add_sources
from alignflow.flows.launch.child import configure_logging
from alignflow.flows.options import REPRODUCE_TOLERANCE, stage_count


def _count(flag: str, what: str = "stages"):
    """An argparse type: a whole number of `what`, at least 1, its error naming `flag`."""
    def parse(text: str) -> int:
        try:
            return stage_count(text, flag, what)
        except AlignflowError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow", description=__doc__)
    parser.add_argument("--version", action="version", version=f"alignflow {md.version('alignflow')}")
    parser.add_argument("--local_rank", type=int, help=argparse.SUPPRESS)  # DeepSpeed's launcher adds it
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help=cmd_plugins.__doc__)
    p.add_argument("action", nargs="?", choices=["show"], help="show NAME: one plugin's config fields")
    p.add_argument("name", nargs="?", help="the plugin to show")
    p.add_argument("--kind", choices=["algorithm", "reward", "sampler", "selector", "environment"], metavar="KIND",
                   help="algorithm, reward, sampler, selector or environment: list only this kind; with `show`, "
                   "when names collide")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("validate", help=cmd_validate.__doc__)
    p.add_argument("pipeline", help="path to a pipeline YAML")
    p.add_argument("--nproc", type=_count("--nproc", "processes"), metavar="N", help="processes (GPUs) per node the memory "
                   "estimate assumes, as `run --nproc` (default: $ALIGNFLOW_NPROC, else 1)")
    p.add_argument("--nnodes", type=_count("--nproc", "processes"), metavar="N", default=1, help="nodes the memory estimate "
                   "assumes (default 1)")
    p.add_argument("--gpu-memory", metavar="SIZE", help="fail when a training stage's estimate exceeds this "
                   "per GPU, e.g. 80GiB (a colocated vLLM sampler's share counted)")
    p.add_argument("--mermaid", action="store_true", help="print only the stage DAG, as a Mermaid flowchart "
                   "(paste it into a ```mermaid block of a Markdown page)")
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("run", help=cmd_run.__doc__)
    p.add_argument("pipeline", help="path to a pipeline YAML")
    p.add_argument("--set", action="append", default=[], metavar="STAGE.FIELD=VALUE",
                   help="override a field of the spec, e.g. sft.settings.lr=1e-3 (repeatable)")
    p.add_argument("--json", action="store_true", help="end stdout with one JSON line (table on stderr)")
    p.add_argument("--artifacts", help="artifacts root: a folder, or a URL shared by machines such as "
                   "s3://bucket/prefix, gs://..., file:///shared/path (default: ./artifacts)")
    p.add_argument("--metrics", type=Path, help="write final metrics JSON here (for dvc metrics)")
    p.add_argument("--plots", type=Path, help="write step curves as CSV under this folder (for dvc plots)")
    p.add_argument("--parallel", type=_count("--parallel"), metavar="N", help="training stages that may run at once, each on "
                   "1/N of the CPU threads (default: $ALIGNFLOW_PARALLEL_STAGES, else one per 8 cores)")
    p.add_argument("--nproc", type=_count("--nproc", "processes"), metavar="N", help="data-parallel processes for each stage "
                   "but select: one per GPU, as torchrun's --nproc_per_node "
                   "(default: $ALIGNFLOW_NPROC, else 1)")
    p.add_argument("--nnodes", metavar="N", help="machines that run each data-parallel stage's ranks together, "
                   "each with --nproc of them; start the same command on every one (default: $ALIGNFLOW_NNODES, "
                   "else 1)")
    p.add_argument("--node-rank", metavar="K", help="this machine's place, 0 to N-1; node 0 runs the pipeline, "
                   "the others lend it their ranks (default: $ALIGNFLOW_NODE_RANK, else 0)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT", help="node 0's address and a free port on it, where "
                   "the nodes meet (c10d rendezvous; default: $ALIGNFLOW_RDZV_ENDPOINT)")
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("data", help=cmd_data.__doc__)
    p.add_argument("--force", action="store_true", help="rewrite data/ even when it exists")
    p.set_defaults(func=cmd_data, source=None)
    sources = p.add_subparsers(dest="source")
    add_sources(sources)

    p = sub.add_parser("reproduce", help=cmd_reproduce.__doc__)
    p.add_argument("run_id", help="the MLflow run id of a pipeline (parent) run, or a run record (metrics/NAME.json)")
    p.add_argument("--seed", type=int, help="a record's seed to rerun (default: its first)")
    p.add_argument("--tolerance", type=float, default=REPRODUCE_TOLERANCE,
                   help="where the environment differs: |recorded - now| <= T x max(1, |recorded|) "
                        "(default %(default)g)")
    p.set_defaults(func=cmd_reproduce)

    p = sub.add_parser("doctor", help=cmd_doctor.__doc__)
    p.add_argument("--lock", type=Path, help="the lock to compare with (default requirements/lock-cpu.txt)")
    p.add_argument("--strict", action="store_true", help="exit 1 when a package or Python differs from the lock "
                   "or bubblewrap does not work")
    p.add_argument("--all", action="store_true", help="list every locked package, not only those that compute")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("deploy", help=cmd_deploy.__doc__)
    p.add_argument("pipeline", help="path to a pipeline YAML")
    p.add_argument("--cron", required=True, help='schedule, e.g. "0 3 * * *"')
    p.add_argument("--pool", default="alignflow", help="process work pool (created if missing)")
    p.add_argument("--name", help="deployment name (default: the pipeline's name)")
    p.set_defaults(func=cmd_deploy)
    return parser


def main(argv: list[str] | None = None) -> int:
    # Prefect gives its ephemeral server 20 s to start, which a busy laptop or CI box can miss.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # offline by design: no telemetry calls
    # Before torch loads (here and in every stage process): OpenMP threads that wait sleep instead of
    # spinning. Beside other busy processes, spinning threads made a training step 1.5-10x and a decode
    # round 3-27x slower on two threads than on one; sleeping ones stay within 0.8-1.1x and 1.0-1.7x.
    # On a machine of its own a run loses some speed by it: OMP_WAIT_POLICY=ACTIVE takes it back
    # (README, "Threads on a shared machine"; benchmarks/threads_under_load.py).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    args = build_parser().parse_args(argv)
    configure_logging()
    try:
        return args.func(args)
    except AlignflowError as exc:
        err_console.print("[bold red]error:[/bold red]", escape(str(exc)), highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
