"""Seeded random subset: `n` rows drawn without replacement, in their original order."""

from __future__ import annotations

import random

from pydantic import Field

from alignflow.core import PluginConfig, Selector, hookimpl


class Subsample(Selector):
    """Keep a seeded random subset of `n` rows; all rows when there are `n` or fewer."""

    class Config(PluginConfig):
        n: int = Field(ge=1)  # rows kept, drawn without replacement (all of them when there are fewer)
        seed: int | None = None  # None: the stage's seed

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        if self.config.seed is not None:
            rng = random.Random(self.config.seed)
        if len(rows) <= self.config.n:
            return list(rows)
        # Sorting the drawn indices keeps the input order, so a curriculum upstream survives.
        keep = sorted(rng.sample(range(len(rows)), self.config.n))
        return [rows[i] for i in keep]


@hookimpl
def register_selectors(register):
    register("subsample", Subsample)
