"""The `alignflow` command line."""

from __future__ import annotations

import argparse
import importlib.metadata as md
import json
import sys

from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.tree import Tree

from alignflow.core.errors import AlignflowError

console = Console()
err_console = Console(stderr=True)


def cmd_plugins(args) -> int:
    """List every loaded plugin: kind, name, distribution, version, description."""
    from alignflow.core.plugins import get_plugins

    rows = [e.as_dict() for e in get_plugins().entries()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="alignflow plugins")
    for col in ("kind", "name", "distribution", "version", "description"):
        table.add_column(col)
    for row in rows:
        table.add_row(*(row[c] for c in ("kind", "name", "distribution", "version", "description")))
    console.print(table)
    return 0


def cmd_validate(args) -> int:
    """Validate a pipeline spec and print its stage DAG."""
    from alignflow.core.spec import load_spec

    spec = load_spec(args.pipeline)
    tree = Tree(f"[bold]{spec.name}[/bold] ({args.pipeline}): {len(spec.stages)} stages, valid")
    for name in spec.order():
        stage = spec.stages[name]
        plugins = [p.name for p in [stage.algorithm, stage.sampler] if p is not None]
        plugins += [r.name for r in stage.rewards] + [s.name for s in stage.selectors]
        node = tree.add(f"[cyan]{name}[/cyan] [dim]{stage.kind}[/dim] {' '.join(plugins)}")
        for field, value in stage.inputs.items():
            node.add(f"{field} <- {value}")
    console.print(tree)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="alignflow", description=__doc__)
    parser.add_argument("--version", action="version", version=f"alignflow {md.version('alignflow')}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plugins", help=cmd_plugins.__doc__)
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=cmd_plugins)

    p = sub.add_parser("validate", help=cmd_validate.__doc__)
    p.add_argument("pipeline", help="path to a pipeline YAML")
    p.set_defaults(func=cmd_validate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except AlignflowError as exc:
        err_console.print("[bold red]error:[/bold red]", escape(str(exc)), highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
