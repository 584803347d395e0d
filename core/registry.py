"""One registry per plugin kind: name -> object, with the distribution that supplied it."""

from __future__ import annotations

import difflib
import inspect
from dataclasses import dataclass
from typing import Any

from alignflow.core.errors import PluginError


@dataclass(frozen=True)
class Entry:
    kind: str
    name: str
    obj: Any
    distribution: str
    version: str
    entry_point: str

    @property
    def description(self) -> str:
        doc = inspect.getdoc(self.obj) or ""
        return doc.strip().splitlines()[0] if doc.strip() else ""

    def as_dict(self) -> dict:
        return {
            "kind": self.kind,
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "description": self.description,
        }


class Registry:
    """Named plugins of one kind ("algorithm", "reward", "sampler", "selector", "environment")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def add(self, entry: Entry) -> None:
        if not isinstance(entry.name, str) or not entry.name:
            raise PluginError(
                f"{entry.distribution} (entry point {entry.entry_point!r}) registered a {self.kind} "
                f"with an invalid name {entry.name!r}: expected a non-empty string"
            )
        old = self._entries.get(entry.name)
        if old is not None:
            raise PluginError(
                f"duplicate {self.kind} name {entry.name!r}: registered by {old.distribution} "
                f"(entry point {old.entry_point!r}) and by {entry.distribution} "
                f"(entry point {entry.entry_point!r}); uninstall one, or restrict loading with "
                f"ALIGNFLOW_PLUGINS"
            )
        self._entries[entry.name] = entry

    def remove(self, name: str) -> None:
        self._entries.pop(name, None)

    def entry(self, name: str) -> Entry:
        try:
            return self._entries[name]
        except KeyError:
            raise PluginError(self.unknown_message(name)) from None

    def get(self, name: str) -> Any:
        return self.entry(name).obj

    def unknown_message(self, name: str) -> str:
        known = sorted(self._entries)
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else "."
        return f"unknown {self.kind} {name!r}{hint} Known {self.kind}s: {', '.join(known) or '(none)'}"

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self):
        return iter(sorted(self._entries.values(), key=lambda e: e.name))

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> list[str]:
        return sorted(self._entries)
