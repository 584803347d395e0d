"""What `alignflow plugins show` prints: a plugin's identity and its config fields, from its pydantic Config."""

from __future__ import annotations

import html
import inspect
import io
import json
import re
import shutil
import tokenize
from typing import Any

from pydantic import TypeAdapter

from alignflow.core.contracts import is_operational
from alignflow.core.registry import Entry


def config_of(obj: Any):
    """The plugin's pydantic `Config` class, or None (a plain function takes no config)."""
    config = getattr(obj, "Config", None)
    return config if inspect.isclass(config) and hasattr(config, "model_fields") else None


def field_comments(config) -> dict[str, str]:
    """Trailing `# comments` of a Config's field lines (its own class first, then its bases): where most
    plugins document a field."""
    comments: dict[str, str] = {}
    for cls in config.__mro__:
        if cls.__module__.startswith("pydantic") or cls is object:
            continue  # pydantic's own source has comments on lines that look like fields
        for name, text in line_comments(cls).items():
            comments.setdefault(name, text)
    return comments


def line_comments(cls) -> dict[str, str]:
    """Each field's comment in one class's own source (not its bases'): the trailing `# comment` of its
    line, else the block of `#` lines right above it."""
    try:
        source = inspect.getsource(cls)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, TypeError, tokenize.TokenError, IndentationError):
        return {}
    comments: dict[str, str] = {}
    for tok in tokens:
        head = tok.line.strip().split(":", 1)[0]
        if tok.type == tokenize.COMMENT and head.isidentifier() and tok.start[1] > tok.line.index(head):
            comments.setdefault(head, tok.string.lstrip("#").strip())
    above: list[str] = []
    for line in source.splitlines():
        text = line.strip()
        if text.startswith("#"):
            above.append(text.lstrip("#").strip())
            continue
        head = text.split(":", 1)[0]
        if above and head.isidentifier() and ":" in text:
            comments.setdefault(head, " ".join(above))
        above = []
    return comments


def _type(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    text = name if name and not getattr(annotation, "__args__", None) else str(annotation)
    text = re.sub(r"\balignflow(?:\.\w+)+\.(\w+)", r"\1", text)  # StageSpec, not alignflow.core.spec.schema.StageSpec
    return text.replace("typing.", "").replace("NoneType", "None")


def _bounds(field) -> str:
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<=", "min_length": "min length", "max_length": "max length"}
    out = []
    for item in field.metadata:
        for attr, sign in signs.items():
            if getattr(item, attr, None) is not None:
                out.append(f"{sign} {getattr(item, attr)}")
    return ", ".join(out)


def fields(obj: Any) -> list[dict]:
    """Each config field: name, type (with bounds), default, description (Field description or comment)."""
    config = config_of(obj)
    if config is None:
        return []
    comments = field_comments(config)
    out = []
    for name, field in config.model_fields.items():
        bounds = _bounds(field)
        out.append({
            "name": name,
            "type": _type(field.annotation) + (f" ({bounds})" if bounds else ""),
            # each field's own default: a config with a required field has no default instance to dump
            "default": "required" if field.is_required() else
            TypeAdapter(Any).dump_python(field.get_default(call_default_factory=True), mode="json"),
            "description": _described(field, field.description or comments.get(name, "")),
        })
    return out


def stage_of(entry: Entry) -> str | None:
    """The stage kind an algorithm serves; None for other plugin kinds."""
    return getattr(entry.obj, "stage", None) or None if entry.kind == "algorithm" else None


def describe(entry: Entry) -> dict:
    """`plugins --json` fields plus the config's JSON schema and field table."""
    config = config_of(entry.obj)
    return {
        **entry.as_dict(),
        "stage": stage_of(entry),
        "entry_point": entry.entry_point,
        "config_schema": config.model_json_schema() if config is not None else None,
        "fields": fields(entry.obj),
        "doc": inspect.getdoc(entry.obj) or "",
    }


def default_text(value: Any) -> str:
    return value if isinstance(value, str) and value == "required" else json.dumps(value)


# The settings models of docs/CONTRACTS.md, in its order: each stage kind's, then the nested blocks.
SETTINGS_MODELS = ("TrainSettings", "PolicySettings", "RLSettings", "PRMSettings", "SelectSettings", "SamplingSettings",
                   "SampleSettings", "CritiqueSettings", "StepLabelSettings", "EvaluateSettings",
                   "GenerationSettings", "ModelOptions", "LoraSettings")


def _cell(text: str, code: bool = False) -> str:
    if code and "|" in text:  # a pipe escaped inside backticks keeps its backslash in Python-Markdown
        return "<code>" + html.escape(text).replace("|", "&#124;") + "</code>"
    text = text.replace("|", "\\|")
    return f"`{text}`" if code and text else text


def _names(items) -> str:
    items = [f"`{x}`" for x in items]
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def settings_tables() -> str:
    """Markdown tables of the stage settings models (`alignflow.core.spec.settings`), each after a bold title."""
    return "\n\n".join(f"**{name}**: " + settings_block(name) for name in SETTINGS_MODELS)


def settings_block(name: str) -> str:
    """One settings model: what it serves, then a table of field, type (with bounds), default (as JSON) and
    description (the Field's description, else the field's comment). A subclass lists only the fields it adds
    or redefines."""
    from alignflow.core.spec import settings
    from alignflow.core.spec.kinds import SETTINGS

    models = [getattr(settings, n) for n in SETTINGS_MODELS]
    model = getattr(settings, name)
    base = model.__bases__[0]
    kinds = [kind for kind, m in SETTINGS.items() if m is model]
    nested = sorted({n for m in models for n, f in m.model_fields.items() if f.annotation is model})
    children = [m.__name__ for m in models if m.__bases__[0] is model]
    about = []
    if kinds:
        about.append(f"Settings of {_names(kinds)} stages.")
    if nested:
        about.append(f"The {_names(nested)} blocks.")
    if children:
        about.append(f"The base of {_names(children)}.")
    doc = model.__dict__.get("__doc__")
    if doc:
        about.append(" ".join(doc.split()))
    if base in models:
        about.append(f"Every `{base.__name__}` field, and these (new or redefined):")
    comments = line_comments(model)
    defaults = model().model_dump(mode="json")
    rows = [_row(n, model.model_fields[n], defaults.get(n), comments) for n in inspect.get_annotations(model)]
    return " ".join(about) + "\n\n" + "\n".join(TABLE_HEAD + rows)


TABLE_HEAD = ["| field | type | default | description |", "|---|---|---|---|"]


def _row(name: str, field, default: Any, comments: dict[str, str]) -> str:
    """One Markdown row: field, type with bounds, default as JSON (or `required`), description."""
    bounds = _bounds(field)
    kind = _type(field.annotation) + (f" ({bounds})" if bounds else "")
    default = "required" if field.is_required() else json.dumps(default)
    description = _described(field, field.description or comments.get(name, ""))
    return f"| `{name}` | {_cell(kind, True)} | {_cell(default, True)} | {_cell(description)} |"


def _described(field, text: str) -> str:
    """A field's description, saying so when it stays out of the stage digest (`operational`)."""
    return f"{text} (not in the digest)".lstrip() if is_operational(field) else text


def model_table(model, notes: dict[str, str] | None = None) -> str:
    """A Markdown table of a pydantic model's fields (its bases' included), as `settings_tables` writes them;
    `notes` describes fields that have neither a Field description nor a comment."""
    comments = {**(notes or {}), **field_comments(model)}
    rows = []
    for name, field in model.model_fields.items():
        default = None if field.is_required() else \
            TypeAdapter(Any).dump_python(field.get_default(call_default_factory=True), mode="json")
        rows.append(_row(name, field, default, comments))
    return "\n".join(TABLE_HEAD + rows)


def plugin_fields_table(obj: Any) -> str:
    """A plugin's config fields as a Markdown table; a sentence when it takes no config."""
    config = config_of(obj)
    return model_table(config) if config is not None and config.model_fields else "No config fields."


def plugin_lines(entries: list[Entry], width: int | None = None) -> str:
    """`alignflow plugins`: one line per plugin, cut to `width` columns (default: the terminal's, $COLUMNS)."""
    width = width or shutil.get_terminal_size().columns
    rows = [("kind", "name", "distribution", "description")]
    rows += [(e.kind, e.name, f"{e.distribution} {e.version}", e.description or "") for e in entries]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = []
    for row in rows:
        line = ("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[3]).rstrip()
        lines.append(line if len(line) <= width else line[:width - 1] + "…")
    return "\n".join(lines)
