"""The `alignflow` commands that show: the plugins, a pipeline's stage DAG and memory estimate, the environment."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from alignflow.core.describe import default_text, describe, plugin_lines
from alignflow.core.errors import AlignflowError, PluginError
from alignflow.core.plugins import get_plugins
from alignflow.core.train.memory import gib, parse_size, pipeline_memory
from alignflow.flows.diagram import mermaid
from alignflow.flows.options import RunOptions
from alignflow.flows.preflight import check_pipeline

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
    checked = check_pipeline(Path(args.pipeline), [], Path.cwd(), early=show_early)
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


def show_early(problems: list[str]) -> None:
    """The problems found before plugin code (and torch) loads, shown while the plugins are checked."""
    err_console.print(f"[bold red]error:[/bold red] {len(problems)} problem{'s' if len(problems) > 1 else ''} "
                      "in the spec, its settings and inputs:", highlight=False)
    for p in problems:
        err_console.print(f"  {escape(p)}", highlight=False, soft_wrap=True)


def cmd_doctor(args) -> int:
    """Compare this environment with the lock (requirements/lock-cpu.txt), and show the CPU kind and whether
    bubblewrap works: what each difference means for reproducing the published numbers; exit 0 unless --strict."""
    from alignflow.flows.doctor import default_lock, report  # torch: not for the quick commands

    return report(args.lock or default_lock(), args.strict, args.all, console)
