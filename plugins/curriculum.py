"""Curriculum ordering: rows sorted easy to hard by a numeric column, ties in their input order."""

from __future__ import annotations

import random
from typing import Literal

from alignflow.core import PluginConfig, Selector, hookimpl
from alignflow.plugins.difficulty import number


class Curriculum(Selector):
    """Order rows easy to hard by `column`: `ascending` for a difficulty (the task's `level`), `descending`
    for a pass rate or a score. A stable sort, so equal rows keep their input order.

    Kimi k1.5 (2025) trains easy to hard by dataset grade labels. This fixes the order of the file written;
    the `sft` and `rl` stages draw a seeded permutation per epoch, so they do not yet follow it.
    """

    class Config(PluginConfig):
        column: str = "level"  # a dotted path reaches into objects: `rewards.judge`
        # ascending for a difficulty (easy first), descending for a pass rate or a score
        order: Literal["ascending", "descending"] = "ascending"

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        keys = [number(row, self.config.column, i) for i, row in enumerate(rows)]
        sign = 1.0 if self.config.order == "ascending" else -1.0
        # Negating the key (not reverse=True) keeps ties in input order when descending too.
        order = sorted(range(len(rows)), key=lambda i: sign * keys[i])
        return [rows[i] for i in order]


@hookimpl
def register_selectors(register):
    register("curriculum", Curriculum)
