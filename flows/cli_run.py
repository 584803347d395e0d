"""The `alignflow` commands that run or write: a pipeline, the datasets, a recorded run again, a deployment."""

from __future__ import annotations

import os
from pathlib import Path

from alignflow.core.errors import AlignflowError, SpecError
from alignflow.flows.api import run_checked
from alignflow.flows.cli_show import console, err_console, show_early
from alignflow.flows.data import DATA_DIR, WRITERS, regenerate_data
from alignflow.flows.launch.nodes import LAUNCHER_VARS, launched_by_deepspeed
from alignflow.flows.options import RunOptions
from alignflow.flows.report import write_curves, write_metrics


def run_options(args) -> RunOptions:
    """The run's options: the flags given, over the ALIGNFLOW_* variables; checked against `--artifacts`."""
    options = RunOptions.from_env(nproc=args.nproc, parallel=args.parallel, nnodes=args.nnodes,
                                  node_rank=args.node_rank, rdzv_endpoint=args.rdzv_endpoint)
    if options.nodes.many and args.artifacts is not None and "://" in str(args.artifacts):
        raise AlignflowError(f"--artifacts {args.artifacts}: the nodes of a run share the artifacts folder "
                             "(checkpoints and outputs of every rank): give a path on a shared filesystem")
    return options


def _from_deepspeed_launcher(args) -> bool:
    """Under DeepSpeed's launcher (`deepspeed [--hostfile H] $(which alignflow) run ...`): the place it gave
    this process as --nnodes/--node-rank/--nproc/--rdzv-endpoint, its variables removed (each stage's ranks
    get theirs from torch's elastic launcher). False for a process that is not its host's local rank 0: that
    host's ranks are started by local rank 0, one set per stage, so it exits."""
    launched = launched_by_deepspeed(os.environ)
    if launched is None:
        return True
    given = [f for f, v in (("--nproc", args.nproc), ("--nnodes", args.nnodes), ("--node-rank", args.node_rank),
                            ("--rdzv-endpoint", args.rdzv_endpoint)) if v is not None]
    if given:
        raise SpecError(f"{', '.join(given)}: started by DeepSpeed's launcher, which sets the processes and nodes "
                        "itself (--num_gpus, --hostfile): leave these out")
    if launched.local_rank != 0:
        console.print(f"DeepSpeed launcher: local rank {launched.local_rank} exits; local rank 0 of this host "
                      f"starts its {launched.nproc} ranks for each stage")
        return False
    args.nproc, args.nnodes, args.node_rank = launched.nproc, str(launched.nodes), str(launched.node)
    args.rdzv_endpoint = launched.endpoint if launched.nodes > 1 else None
    for var in LAUNCHER_VARS:  # torch would take them for the stages' ranks, which get theirs from its launcher
        os.environ.pop(var, None)
    return True


def cmd_run(args) -> int:
    """Run a pipeline: stages whose artifacts are finished are reused, the rest run."""
    if not _from_deepspeed_launcher(args):
        return 0
    options = run_options(args)
    report = run_checked(Path(args.pipeline), args.set, Path.cwd(), args.artifacts, options, early=show_early)
    if isinstance(report, dict):  # a node other than 0: it lent its ranks
        nodes = options.nodes
        console.print(f"node {nodes.rank} of {nodes.count}: " + ", ".join(f"{k} {v}" for k, v in report.items()))
        return 0
    report.render(err_console if args.json else console)
    if args.metrics:
        write_metrics(report, args.metrics)
    if args.plots:
        write_curves(report, args.plots)
    if args.json:
        print(report.as_json(), flush=True)
    return 1 if report.failed else 0


def cmd_data(args) -> int:
    """Regenerate every dataset under data/ (byte-identical: data.dvc stays unchanged): the bundled task's and the
    recipes' (data/tool-use, data/reasoning-gym, data/multidomain); or write one source's (`data tool-use`,
    `data reasoning-gym TASK`, worked step-wise solutions of several: `data reasoning-gym-steps --tasks A,B`)."""
    if args.source:
        for line in WRITERS[args.source](args):
            console.print(line)
        return 0
    if (Path.cwd() / DATA_DIR).is_dir() and not args.force:
        console.print(f"{DATA_DIR}/ exists; pass --force to rewrite it")
        return 0
    for name, path in regenerate_data(Path.cwd()).items():
        console.print(f"{name}: {path}")
    return 0


def cmd_reproduce(args) -> int:
    """Rerun a recorded pipeline run (MLflow parent run id) from scratch and compare its final metrics: exit 0
    when they match exactly, 3 when the environment differs and they match within --tolerance, else 1. Given a
    run record (metrics/NAME.json), rerun one of its seeds and judge it against the record's seed band."""
    from alignflow.flows.reproduce import reproduce  # MLflow, Prefect and torch: not for the quick commands

    if args.run_id.endswith(".json"):  # a committed run record: judged against its seed band (flows/records.py)
        from alignflow.flows.records import check_record, render
        return render(check_record(Path(args.run_id), Path.cwd(), RunOptions.from_env(), args.seed), console)
    done = reproduce(args.run_id, Path.cwd(), RunOptions.from_env(), args.tolerance)
    done.report.render(console)
    if done.environment:
        console.print("[yellow]the environment differs from the recorded run's[/yellow] (recorded -> now):")
        for key, (recorded, now) in done.environment.items():
            console.print(f"  {key}: {recorded} -> {now}")
    if done.timed:
        console.print(f"stages {', '.join(done.timed)} ran asynchronous rollouts on the newest weights, which depend on "
                      f"timing: their metrics are compared within tolerance {done.tolerance:g}")
    for key, (recorded, now) in sorted(done.mismatches.items()):
        console.print(f"[red]{key}[/red]: recorded {recorded}, reproduced {now}")
    if done.code == 0 and done.timed:
        console.print(f"[green]final metrics match within tolerance {done.tolerance:g}[/green]")
    elif done.code == 0:
        console.print("[green]final metrics match exactly[/green]")
    elif done.code == 3:
        console.print(f"[green]final metrics match within tolerance {done.tolerance:g}[/green] "
                      "(another environment: exact equality is not expected)")
    else:
        where = f"within tolerance {done.tolerance:g}" if done.environment else "exactly"
        console.print(f"[red]not reproduced[/red] ({where})")
    return done.code


def cmd_deploy(args) -> int:
    """Create a scheduled Prefect deployment of a pipeline on a process work pool."""
    from alignflow.flows.deploy import deploy  # Prefect and torch: not for the quick commands

    name, stage_pools = deploy(Path(args.pipeline), args.cron, args.pool, Path.cwd(), args.name)
    console.print(f"deployment {name!r} on work pool {args.pool!r}, schedule {args.cron!r}")
    console.print(f"start a worker:   prefect worker start --pool {args.pool}")
    for pool in stage_pools:  # where the stages that name a pool run
        console.print(f"  and one for the stages on pool {pool!r}: prefect worker start --pool {pool}")
    console.print(f"run it now:       prefect deployment run '{name}'")
    console.print("watch the runs:   prefect flow-run ls  (or the UI: prefect server start)")
    return 0
