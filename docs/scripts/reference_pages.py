"""The generated reference pages: command line, pipeline YAML, stage kinds, settings, plugins, environment
variables. Each function returns {path under docs/reference/: Markdown}; gen_reference.py writes them."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("core", "flows", "plugins")
HELP_COLUMNS = 80  # what fits a code block at 1280 px beside both sidebars (check_site.py)

# What each ALIGNFLOW_ variable the code reads does; the build fails on one missing here or no longer read.
ENVIRONMENT = {
    "ALIGNFLOW_PLUGINS": "comma-separated entry-point or distribution names: only those load "
                         "(`ALIGNFLOW_PLUGINS=alignflow` loads only the built-ins)",
    "ALIGNFLOW_PARALLEL_STAGES": "training, sampling and evaluation stages that may run at once, each on 1/N of "
                                 "the torch threads; `run --parallel` wins (default: one per 8 CPU cores)",
    "ALIGNFLOW_NPROC": "data-parallel processes per node for each stage but `select`; `--nproc` wins (default 1)",
    "ALIGNFLOW_NNODES": "machines that run each data-parallel stage's ranks together; `--nnodes` wins (default 1)",
    "ALIGNFLOW_NODE_RANK": "this machine's place, 0 to N-1; node 0 runs the pipeline; `--node-rank` wins",
    "ALIGNFLOW_RDZV_ENDPOINT": "node 0's `HOST:PORT` where the nodes meet (c10d rendezvous); `--rdzv-endpoint` wins",
    "ALIGNFLOW_POOL_TIMEOUT": "seconds a stage sent to a work pool waits for a worker before it is cancelled (600)",
    "ALIGNFLOW_CACHE": "local cache of a URL artifact store: stages run there and inputs are downloaded once "
                       "(default `~/.cache/alignflow`)",
    "ALIGNFLOW_ARTIFACT_LOCK": "`lease` (default): one run of a stage at a time on any machine; `none` when only "
                               "one run writes at a time on a backend that cannot create a file only if absent",
    "ALIGNFLOW_LOCK_LEASE_S": "seconds after its last heartbeat that a dead run's stage lock may be taken (120)",
    "ALIGNFLOW_AUTO_PRECISION": "`fp32` or `bf16-mixed`: what `precision: auto` resolves to, without probing the "
                                "hardware (the test suite sets `fp32`, so its exact comparisons agree on every "
                                "CPU); unset: auto decides",
    "ALIGNFLOW_AUTO_OVERLAP": "`false`: `overlap_rollouts: auto` stays off (the test suite sets it, so its exact "
                              "comparisons see the synchronous rl stage); unset: auto decides",
    "ALIGNFLOW_ROW": "set by the `openai_agent` environment for the program it starts per episode: the dataset row "
                     "as JSON (also on its standard input); not read by alignflow",
    "ALIGNFLOW_SEED": "set by the `openai_agent` environment for the program it starts per episode: the episode's "
                      "seed; not read by alignflow",
    "ALIGNFLOW_OWN_PROCESS_GROUP": "internal: set beside RANK, WORLD_SIZE and MASTER_* when alignflow formed a "
                                   "one-process group itself, so processes started from it do not take them for a "
                                   "launcher's; not for users",
}


def _subparsers(parser):
    return next((a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"), None)


def _help_sections(parser, level: int) -> list[str]:
    """Each subcommand's help under a heading, its own subcommands (`data reasoning-gym`) one level deeper."""
    subs, out = _subparsers(parser), []
    for sub in (subs.choices.values() if subs else ()):
        out += ["", f"{'#' * level} {sub.prog}", "", "```text", sub.format_help().rstrip(), "```"]
        out += _help_sections(sub, level + 1)
    return out


def cli_pages() -> dict[str, str]:
    """`alignflow --help` and every subcommand's, nested ones included, as argparse prints them."""
    from alignflow.flows.cli import build_parser

    parser, columns = build_parser(), os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(HELP_COLUMNS)  # argparse wraps at the terminal's width: fix it, for this page only
    try:
        out = ["# Command line", "", "Generated from the argument parser of `alignflow` at build time.", "",
               "```text", parser.format_help().rstrip(), "```", *_help_sections(parser, 2)]
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
    return {"cli.md": "\n".join(out) + "\n"}


# Descriptions of the spec fields whose source has none (a field that disappears fails the build).
FIELD_NOTES = {
    "PipelineSpec.name": "the pipeline's name; its final model is registered in MLflow under it",
    "PipelineSpec.description": "one line for people; not part of any digest",
    "PipelineSpec.seed": "the seed of every stage that sets none (loop round r: seed + r - 1)",
    "PipelineSpec.stages": "stage name -> stage, or -> a loop (`repeat`, `first`, `stages`)",
    "StageSpec.kind": "what the stage does ([stage kinds](stage-kinds.md))",
    "StageSpec.inputs": "input name -> a local path, a hub id, `builtin:tiny`, or `stage:NAME` (another stage's output)",
    "StageSpec.algorithm": "the training objective (training kinds)",
    "StageSpec.rewards": "rewards, weighted and summed (RL, sampling, evaluation; a `select` stage's scores)",
    "StageSpec.sampler": "what generates (stages that sample; default `hf`)",
    "StageSpec.selectors": "row selectors applied in order (`select` stages)",
    "StageSpec.settings": "validated by the kind's settings model ([settings](settings.md))",
    "LoopSpec.repeat": "rounds to run; not part of any digest, so raising it runs only the new rounds",
    "LoopSpec.first": "what round 1 reads for `stage:X@prev`: loop stage X -> `stage:NAME` outside the loop",
    "LoopSpec.stages": "the stages of one round; `stage:X` is X of the same round, `stage:X@prev` of the previous",
    "PluginRef.name": "a registered plugin's name (`alignflow plugins`)",
    "PluginRef.config": "validated by the plugin's `Config`; `${inputs.NAME}` becomes the stage's input NAME",
    "RewardRef.weight": "the reward's weight in the stage's total",
}


def pipeline_pages() -> dict[str, str]:
    """The fields of a pipeline YAML, from the pydantic models that parse it."""
    from alignflow.core.describe import model_table
    from alignflow.core.environments.mcp import McpServer
    from alignflow.core.spec.rounds import LoopSpec
    from alignflow.core.spec.schema import PipelineSpec, PluginRef, RewardRef, StageSpec
    from alignflow.core.spec.stage import EnvironmentRef

    out = ["# Pipeline YAML", "", "Generated from the pydantic models that parse a pipeline file. Unknown fields "
           "are errors. A stage's `settings` are validated by its kind's model ([settings](settings.md)); a "
           "plugin's `config` by the plugin's own `Config` ([plugins](plugins.md)).", ""]
    for title, model in (("The pipeline", PipelineSpec), ("A stage", StageSpec), ("A loop", LoopSpec),
                         ("A plugin reference", PluginRef), ("A reward reference", RewardRef),
                         ("The `environment:` block", EnvironmentRef), ("An MCP server", McpServer)):
        owners = [cls.__name__ for cls in reversed(model.__mro__)]  # a base's note serves a subclass
        notes = {k.split(".", 1)[1]: v for k, v in FIELD_NOTES.items() if k.split(".", 1)[0] in owners}
        stale = {k for k in FIELD_NOTES if k.startswith(model.__name__ + ".")} - \
            {f"{model.__name__}.{name}" for name in model.model_fields}
        if stale:
            raise SystemExit(f"docs/scripts/reference_pages.py FIELD_NOTES: {model.__name__} has no field {stale}")
        about = " ".join((model.__doc__ or "").split())
        out += [f"## {title}: `{model.__name__}`", "", *([about, ""] if about else []), model_table(model, notes), ""]
    out += ["A plugin reference may be a bare name (`algorithm: grpo`) or `{name: grpo, config: {...}}`. An "
            "`environment:` block names its plugin and config as any plugin reference, and sets the stage's limits "
            "on each episode beside them ([Environments and tools](../guides/environments.md)).", ""]
    return {"pipeline.md": "\n".join(out)}


def kinds_pages() -> dict[str, str]:
    """The stage-kind table, from the one record per kind."""
    from alignflow.core.spec.kinds import kinds_markdown

    return {"stage-kinds.md": "\n".join(["# Stage kinds", "", "Generated from the stage-kind records at build time. "
                                         "What each kind does is in [Pipelines](../concepts/pipelines.md).", "",
                                         kinds_markdown(), ""])}


# The settings pages: (file, title, what they hold, models in order).
SETTINGS_PAGES = (
    ("training", "Training stages", "What `sft`, `preference`, `reward_model`, `prm` and `rl` stages take.",
     ("TrainSettings", "PolicySettings", "RLSettings", "PRMSettings")),
    ("sampling", "Sampling, evaluation and selection", "What stages that sample without training, and `select` "
     "stages, take.", ("SamplingSettings", "SampleSettings", "CritiqueSettings", "StepLabelSettings",
                       "EvaluateSettings", "SelectSettings")),
    ("blocks", "Nested blocks", "Blocks that several settings models hold: `generation`, `model`, `lora`.",
     ("GenerationSettings", "ModelOptions", "LoraSettings")),
)


def settings_pages() -> dict[str, str]:
    """An index (kind -> its settings model) and one page per group of models, a heading per model."""
    from alignflow.core.describe import SETTINGS_MODELS, settings_block
    from alignflow.core.spec.kinds import SETTINGS

    where = {model: page for page, _, _, models in SETTINGS_PAGES for model in models}
    missing = set(SETTINGS_MODELS) ^ set(where)
    if missing:
        raise SystemExit(f"docs/scripts/reference_pages.py SETTINGS_PAGES: place or drop {sorted(missing)}")
    index = ["# Stage settings", "", "Generated from `core/spec/settings.py` at build time. A stage's `settings:` "
             "block is validated by its kind's model; unknown fields are errors.", "",
             "| stage kind | settings model |", "|---|---|"]
    index += [f"| `{kind}` | [{m.__name__}](settings/{where[m.__name__]}.md#{m.__name__.lower()}) |"
              for kind, m in SETTINGS.items()]
    index += ["", *[f"- [{title}](settings/{page}.md): {about}" for page, title, about, _ in SETTINGS_PAGES], ""]
    pages = {"settings.md": "\n".join(index)}
    for page, title, about, models in SETTINGS_PAGES:
        body = [f"# {title}", "", about + " Generated from `core/spec/settings.py`; the models of every kind: "
                "[Stage settings](../settings.md).", ""]
        for name in models:
            body += [f"## {name}", "", settings_block(name), ""]
        pages[f"settings/{page}.md"] = "\n".join(body)
    return pages


KIND_PAGES = {"algorithm": "algorithms", "reward": "rewards", "sampler": "samplers", "selector": "selectors",
              "environment": "environments"}


def plugin_pages() -> dict[str, str]:
    """An index of every built-in plugin by kind, and one page per kind: a table of contents, then each plugin
    with its config fields."""
    from alignflow.core.describe import plugin_fields_table
    from alignflow.core.plugins import KINDS, get_plugins

    entries = [e for e in get_plugins().entries() if e.distribution == "alignflow"]
    index = ["# Built-in plugins", "", "Generated from the plugin registry at build time (`alignflow plugins show "
             "NAME` prints the same for any installed plugin). Config fields go under the plugin's `config:` in a "
             "pipeline. One page per kind:", ""]
    pages = {}
    for kind in KINDS.values():  # every plugin kind, in the hooks' order
        page, mine = KIND_PAGES[kind], [e for e in entries if e.kind == kind]
        stages = kind == "algorithm"
        head = ["| plugin | stage | what it is |", "|---|---|---|"] if stages else \
            ["| plugin | what it is |", "|---|---|"]
        toc = [f"| [`{e.name}`](#{_anchor(e.name)}) | " + (f"`{e.obj.stage}` | " if stages else "")
               + _one_line(e.description) + " |" for e in mine]
        index += [f"## [{page.capitalize()}](plugins/{page}.md)", "", *head,
                  *[row.replace("](#", f"](plugins/{page}.md#", 1) for row in toc], ""]
        body = [f"# {page.capitalize()}", "", f"Every built-in {kind} plugin, generated from the registry; "
                "[all kinds](../plugins.md).", "", *head, *toc, ""]
        for e in mine:
            serves = f"*{e.obj.stage} stages.* " if stages and getattr(e.obj, "stage", "") else ""
            body += [f"## `{e.name}`", "", serves + e.description, "", plugin_fields_table(e.obj), ""]
        pages[f"plugins/{page}.md"] = "\n".join(body)
    pages["plugins.md"] = "\n".join(index)
    return pages


def _anchor(name: str) -> str:
    """The id Python-Markdown's toc gives a heading `` `name` ``."""
    return re.sub(r"[^\w-]", "", name.lower())


def _one_line(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def environment_pages() -> dict[str, str]:
    """Every ALIGNFLOW_ variable the source reads, with what it does."""
    found = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*.py"):
            found |= set(re.findall(r"ALIGNFLOW_[A-Z_]+[A-Z]", path.read_text()))
    missing, stale = sorted(found - set(ENVIRONMENT)), sorted(set(ENVIRONMENT) - found)
    if missing or stale:
        raise SystemExit(f"docs/scripts/reference_pages.py ENVIRONMENT: describe {missing}, drop {stale}")
    rows = ["| variable | what it does |", "|---|---|"] + [f"| `{k}` | {ENVIRONMENT[k]} |" for k in sorted(found)]
    return {"environment.md": "\n".join([
        "# Environment variables", "", "Every `ALIGNFLOW_*` variable the code reads (the list is checked against "
        "the source at build time). A command-line flag, where there is one, wins.", "", *rows, "",
        "Other libraries' variables alignflow sets or honours: `OMP_WAIT_POLICY` (set to `PASSIVE` unless set: "
        "[threads](../guides/threads.md)), `MLFLOW_TRACKING_URI`, `PREFECT_API_URL` "
        "([tracking](../guides/tracking.md)).", ""])}


def all_pages() -> dict[str, str]:
    """Every generated reference page, {path under reference/: Markdown}."""
    from api_pages import api_pages

    pages = {}
    for build in (cli_pages, pipeline_pages, kinds_pages, settings_pages, plugin_pages, environment_pages, api_pages):
        pages.update(build())
    return pages
