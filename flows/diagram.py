"""A pipeline's stage DAG as a Mermaid flowchart (`alignflow validate --mermaid`, the docs' pictures)."""

from __future__ import annotations

from alignflow.core.spec.schema import PipelineSpec

STAGE_PREFIX = "stage:"


def _text(value: str) -> str:
    """A label Mermaid reads literally inside double quotes."""
    return value.replace("&", "#amp;").replace('"', "#quot;").replace("<", "#lt;").replace(">", "#gt;")


def _stage_label(spec: PipelineSpec, name: str) -> str:
    stage = spec.stages[name]
    plugins = [p.name for p in (stage.algorithm, stage.sampler, stage.environment) if p is not None]
    plugins += [r.name for r in stage.rewards] + [s.name for s in stage.selectors]
    pool = spec.pool_of(name)
    lines = [f"<b>{_text(name)}</b>", _text(stage.kind + (": " + ", ".join(plugins) if plugins else ""))]
    return "<br/>".join(lines + ([f"on pool {_text(pool)}"] if pool else []))


def mermaid(spec: PipelineSpec) -> str:
    """`flowchart LR`: one box per stage (name, kind, plugins, work pool), one stadium per outside input (a file,
    a hub id, `builtin:tiny`), an arrow per input labelled with its name; a loop's rounds as nested subgraphs."""
    ids = {name: f"s{i}" for i, name in enumerate(spec.order())}
    sources: dict[str, str] = {}  # an outside input's value -> its node id
    body, edges, groups = [], [], {}  # groups: loop -> round -> stage names
    for name in ids:
        of = spec.round_of(name)
        if of is None:
            body.append(f'  {ids[name]}["{_stage_label(spec, name)}"]')
        else:
            groups.setdefault(of.loop, {}).setdefault(of.round, []).append(name)
        for field, value in spec.stages[name].inputs.items():
            if value.startswith(STAGE_PREFIX) and value[len(STAGE_PREFIX):] in ids:
                origin = ids[value[len(STAGE_PREFIX):]]
            else:
                if value not in sources:
                    sources[value] = f"i{len(sources)}"
                    body.append(f'  {sources[value]}(["{_text(value)}"])')
                origin = sources[value]
            edges.append(f'  {origin} -- "{_text(field)}" --> {ids[name]}')
    for loop, rounds in groups.items():
        body.append(f'  subgraph {_id(loop)}["{_text(loop)}: loop of {_rounds(spec.loops[loop].repeat)}"]')
        for round_, names in rounds.items():
            body.append(f'    subgraph {_id(loop)}_r{round_}["round {round_}"]')
            body += [f'      {ids[n]}["{_stage_label(spec, n)}"]' for n in names]
            body.append("    end")
        body.append("  end")
    return "\n".join(["flowchart LR", *body, *edges]) + "\n"


def _id(name: str) -> str:
    """A Mermaid node id from a loop name (letters, digits and `_`)."""
    return "loop_" + "".join(c if c.isalnum() else "_" for c in name)


def _rounds(repeat: int) -> str:
    return f"{repeat} round{'s' if repeat > 1 else ''}"
