"""Exact-duplicate prompt removal: keeps the first row of each distinct prompt."""

from __future__ import annotations

import random

from alignflow.core import PluginConfig, Selector, hookimpl


class Dedup(Selector):
    """Drop rows whose `column` value (after optional whitespace stripping) was already seen."""

    class Config(PluginConfig):
        column: str = "prompt"  # the value rows are compared by
        strip: bool = True  # " 2+2" and "2+2 " are the same prompt

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        seen: set[str] = set()
        kept = []
        for row in rows:
            key = str(row.get(self.config.column, ""))
            key = key.strip() if self.config.strip else key
            if key not in seen:
                seen.add(key)
                kept.append(row)
        return kept


@hookimpl
def register_selectors(register):
    register("dedup", Dedup)
