"""The `alignflow` command line."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from alignflow.core.describe import default_text, describe, plugin_lines
from alignflow.core.errors import AlignflowError, PluginError, SpecError
from alignflow.core.train.memory import gib, parse_size, pipeline_memory
from alignflow.core.plugins import get_plugins
from alignflow.flows.api import run_checked
from alignflow.flows.launch.child import configure_logging
from alignflow.flows.data import DATA_DIR, WRITERS, add_sources, regenerate_data
from alignflow.flows.diagram import mermaid
from alignflow.flows.launch.nodes import LAUNCHER_VARS, launched_by_deepspeed
from alignflow.flows.options import REPRODUCE_TOLERANCE, RunOptions, stage_count
from alignflow.flows.preflight import check_pipeline
from alignflow.flows.report import write_curves, write_metrics

console = Console()
err_console = Console(stderr=True)


def cmd_plugins(args) -> int:
    """List the loaded plugins (all, or one --kind's): kind, name, distribution, version, description; `show NAME`."""
    entries = get_plugins().entries()
    if args.action == "show":
        return _show_plugin(args, [e for e in entries if e.name == args.name])
    if args.kind:
        entries = [e for e in entries if e.kind == args.kind]
    if args.json:
        keys = ("kind", "name", "distribution", "version", "description", "stage", "entry_point", "config_schema")
        print(json.dumps([{k: d[k] for k in keys} for d in map(describe, entries)], indent=2))
        return 0
    print(plugin_lines(entries))  # one line per plugin, cut to the terminal's width
    return 0


def _show_plugin(args, matches) -> int:
    if args.kind:
        matches = [e for e in matches if e.kind == args.kind]
    if not args.name or not matches:
        raise PluginError(f"no plugin named {args.name!r}" + (f" of kind {args.kind!r}" if args.kind else "")
                          + "; `alignflow plugins` lists them")
    described = [describe(e) for e in matches]
    if args.json:
        print(json.dumps(described if len(described) > 1 else described[0], indent=2))
        return 0
    for d in described:
        serves = f", serves {d['stage']} stages" if d["stage"] else ""
        console.print(f"[bold]{d['kind']} {d['name']}[/bold]{serves}: {d['distribution']} {d['version']} "
                      f"(entry point {d['entry_point']!r})", highlight=False)
        if d["doc"]:
            console.print(d["doc"], highlight=False, soft_wrap=True)
        if not d["fields"]:
            console.print("[dim]no config[/dim]")
            continue
        table = Table(title=f"{d['name']}.config")
        for col in ("field", "type", "default", "description"):
            table.add_column(col)
        for f in d["fields"]:
            table.add_row(f["name"], f["type"], default_text(f["default"]), f["description"])
        console.print(table)
    return 0


def cmd_validate(args) -> int:
    """Validate a pipeline spec, print its stage DAG and each training stage's estimated memory per GPU."""
    checked = check_pipeline(Path(args.pipeline), [], Path.cwd(), early=_show_early)
    spec = checked.spec
    if args.mermaid:  # plain text for a Markdown page: no colours, no memory estimate
        print(mermaid(spec), end="")
        return 0
    console.print(dag_tree(spec, args.pipeline))
    return show_memory(checked, args)


def show_memory(checked, args) -> int:
    """Each training stage's estimated memory per GPU (core/train/memory.py); 1 when one exceeds --gpu-memory."""
    limit = parse_size(args.gpu_memory) if args.gpu_memory else None
    gpus = RunOptions.from_env(nproc=args.nproc).nproc
    estimates = pipeline_memory(checked.spec, checked.stages, Path.cwd(), gpus, args.nnodes)
    if not estimates:
        return 0
    console.print(f"[bold]memory per GPU[/bold] ({gpus} process{'es' if gpus > 1 else ''} per node x {args.nnodes} "
                  f"node{'s' if args.nnodes > 1 else ''}; --nproc, --nnodes):", highlight=False)
    over = []
    for m in estimates:
        console.print(f"  {escape(m.line())}", highlight=False, soft_wrap=True)
        if limit is None or m.why:
            continue
        need = m.gpu + int((m.sampler_share or 0.0) * limit)
        if need > limit:
            over.append(f"stage {m.stage!r}: needs {gib(need)} per GPU"
                        f"{' with its vLLM share' if m.sampler_share else ''}, more than --gpu-memory "
                        f"{gib(limit)} (before activations): offload (offload_optimizer/offload_params: cpu), a "
                        f"higher zero_stage or more GPUs")
    if over:
        raise AlignflowError("\n".join(over))
    return 0


def dag_tree(spec, source: str) -> Tree:
    """The stage DAG in dependency order, each stage with what it reads; a loop's stages under their round."""
    tree = Tree(f"[bold]{spec.name}[/bold] ({source}): {len(spec.stages)} stages, valid")
    parents = {}  # loop name, or (loop name, round) -> its node
    for name in spec.order():
        stage, of, parent = spec.stages[name], spec.round_of(name), tree
        if of is not None:
            if of.loop not in parents:
                loop = spec.loops[of.loop]
                parents[of.loop] = tree.add(f"[bold]{of.loop}[/bold]: loop of {loop.repeat} round"
                                            f"{'s' if loop.repeat > 1 else ''} over {', '.join(loop.stages)}")
            parent = parents.get((of.loop, of.round)) or parents[of.loop].add(f"round {of.round}")
            parents[(of.loop, of.round)] = parent
        plugins = [p.name for p in [stage.algorithm, stage.sampler, stage.environment] if p is not None]
        plugins += [r.name for r in stage.rewards] + [s.name for s in stage.selectors]
        pool = spec.pool_of(name)  # runs on a worker of that Prefect work pool (flows/launch/pools.py)
        node = parent.add(f"[cyan]{name}[/cyan] [dim]{stage.kind}[/dim] {' '.join(plugins)}"
                          + (f" [magenta]on pool {pool}[/magenta]" if pool else ""))
        for field, value in stage.inputs.items():
            node.add(f"{field} <- {value}")
    return tree


def _show_early(problems: list[str]) -> None:
    """The problems found before plugin code (and torch) loads, shown while the plugins are checked."""
    err_console.print(f"[bold red]error:[/bold red] {len(problems)} problem{'s' if len(problems) > 1 else ''} "
                      "in the spec, its settings and inputs:", highlight=False)
    for p in problems:
        err_console.print(f"  {escape(p)}", highlight=False, soft_wrap=True)


def _stage_count(text: str) -> int:
    try:
        return stage_count(text, "--parallel")
    except AlignflowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _process_count(text: str) -> int:
    try:
        return stage_count(text, "--nproc", "processes")
    except AlignflowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    report = run_checked(Path(args.pipeline), args.set, Path.cwd(), args.artifacts, options, early=_show_early)
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


def cmd_doctor(args) -> int:
    """Compare this environment with the lock (requirements/lock-cpu.txt), and show the CPU kind and whether
    bubblewrap works: what each difference means for reproducing the published numbers; exit 0 unless --strict."""
    from alignflow.flows.doctor import default_lock, report  # torch: not for the quick commands

    return report(args.lock or default_lock(), args.strict, args.all, console)


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
    p.add_argument("--nproc", type=_process_count, metavar="N", help="processes (GPUs) per node the memory "
                   "estimate assumes, as `run --nproc` (default: $ALIGNFLOW_NPROC, else 1)")
    p.add_argument("--nnodes", type=_process_count, metavar="N", default=1, help="nodes the memory estimate "
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
    p.add_argument("--parallel", type=_stage_count, metavar="N", help="training stages that may run at once, each on "
                   "1/N of the CPU threads (default: $ALIGNFLOW_PARALLEL_STAGES, else one per 8 cores)")
    p.add_argument("--nproc", type=_process_count, metavar="N", help="data-parallel processes for each stage "
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
