"""What `alignflow plugins show` prints: a plugin's identity and its config fields, from its pydantic Config."""

from __future__ import annotations

import inspect
import io
import json
import tokenize
from typing import Any

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
        try:
            source = inspect.getsource(cls)
            tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        except (OSError, TypeError, tokenize.TokenError, IndentationError):
            continue
        for tok in tokens:
            head = tok.line.strip().split(":", 1)[0]
            if tok.type == tokenize.COMMENT and head.isidentifier() and tok.start[1] > tok.line.index(head):
                comments.setdefault(head, tok.string.lstrip("#").strip())
    return comments


def _type(annotation: Any) -> str:
    name = getattr(annotation, "__name__", None)
    text = name if name and not getattr(annotation, "__args__", None) else str(annotation)
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
    try:
        defaults = config().model_dump(mode="json")
    except Exception:  # a required field: no default instance
        defaults = {}
    out = []
    for name, field in config.model_fields.items():
        bounds = _bounds(field)
        out.append({
            "name": name,
            "type": _type(field.annotation) + (f" ({bounds})" if bounds else ""),
            "default": defaults.get(name, "required" if field.is_required() else None),
            "description": field.description or comments.get(name, ""),
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
