"""The API pages: mkdocstrings renders each class and function from its docstring; the attributes, which the code
documents by comments (a flag, a dataclass field), get a table here, under their class."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import html

# page -> (title, what it holds, [(module, [public names, in the page's order])])
API = {
    "contracts.md": ("Contracts", "The base classes every plugin builds on; the flags of each class tell a stage "
                     "what to prepare.", [("alignflow.core.contracts", ["PluginConfig", "Algorithm", "Sampler",
                                                                         "Selector", "operational"])]),
    "rl.md": ("RL algorithms", "The RL contract: the rollout an algorithm reads, the batch its loss gets, the base "
              "classes and their flags.", [("alignflow.core.rl.algorithm", [
                  "Rollout", "PolicyBatch", "RLAlgorithm", "KLLossConfig", "PolicyGradientConfig", "PolicyGradient",
                  "with_kl_loss", "sampler_corrected"])]),
    "environments.md": ("Environments", "The environment contract: what an episode's environment gets each turn and "
                        "answers ([Environments and tools](../../guides/environments.md)).",
                        [("alignflow.core.environments.contract", ["Environment", "Turn", "Step", "Limits",
                                                                   "EpisodeError"])]),
    "python.md": ("Python API", "Run and validate pipelines from notebooks and scripts, as the command line does "
                  "([The Python API](../../guides/python-api.md)).",
                  [("alignflow.flows.api", ["run", "validate", "RunResult"]),
                   ("alignflow.flows.options", ["RunOptions", "Nodes"])]),
}


def attributes(cls) -> list[dict]:
    """A class's own annotated attributes in source order: name, type, default and the comment that documents
    it (its line's, else the `#` lines above it); pydantic fields and dataclass fields alike."""
    from alignflow.core.describe import line_comments

    comments = line_comments(cls)
    pydantic = getattr(cls, "model_fields", None) or {}
    fields = {f.name: f for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else {}
    out = []
    for name, annotation in inspect.get_annotations(cls).items():
        if name.startswith("_") or name == "model_config":
            continue
        out.append({"name": name, "type": annotation if isinstance(annotation, str) else _name(annotation),
                    "default": _default(cls, name, pydantic.get(name), fields.get(name)),
                    "description": pydantic[name].description if name in pydantic and pydantic[name].description
                    else comments.get(name, "")})
    return out


def _default(cls, name: str, field, data) -> str:
    if field is not None:
        return "required" if field.is_required() else _text(field.get_default(call_default_factory=True))
    if data is not None:
        if data.default is not dataclasses.MISSING:
            return _text(data.default)
        return _text(data.default_factory()) if data.default_factory is not dataclasses.MISSING else "required"
    return _text(cls.__dict__[name]) if name in cls.__dict__ else "required"


def _name(value) -> str:
    return getattr(value, "__name__", None) or str(value)


def _text(value) -> str:
    """A default as Python writes it (these are Python objects, not YAML): a class by its name."""
    return value.__name__ if inspect.isclass(value) else repr(value)


def _code(text: str) -> str:
    """Inline code; a pipe inside backticks would keep its escaping backslash in Python-Markdown."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>" if "|" in text else f"`{text}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def attribute_table(cls) -> str:
    rows = ["| attribute | type | default | description |", "|---|---|---|---|"]
    rows += [f"| `{a['name']}` | {_code(a['type'])} | {_code(a['default'])} | {_cell(a['description'])} |"
             for a in attributes(cls)]
    return "\n".join(rows)


def _title(cls) -> str:
    if dataclasses.is_dataclass(cls) or hasattr(cls, "model_fields"):
        return f"Fields of `{cls.__name__}`"
    return f"Flags of `{cls.__name__}`"


def api_pages() -> dict[str, str]:
    """{api/PAGE: Markdown}: each module's docstring, then each name's mkdocstrings block and attribute table."""
    pages = {}
    for page, (title, about, modules) in API.items():
        out = [f"# {title}", "", about, ""]
        for module, names in modules:
            loaded = importlib.import_module(module)
            out += [f"::: {module}", "    options:", "      members: false", "      show_root_heading: false", ""]
            for name in names:
                obj = getattr(loaded, name)
                out += [f"::: {module}.{name}", ""]
                if inspect.isclass(obj) and attributes(obj):
                    out += [f"**{_title(obj)}**", "", attribute_table(obj), ""]
        pages[f"api/{page}"] = "\n".join(out)
    return pages
