"""Difficulty filter: keep prompts whose pass rate lies in [min_pass, max_pass]."""

from __future__ import annotations

import random

from pydantic import Field, model_validator

from alignflow.core import DataError, PluginConfig, Selector, hookimpl


def number(row: dict, column: str, i: int) -> float:
    """The numeric value at `column` of row i (a dotted path reaches into objects: `rewards.judge`)."""
    value: object = row
    for key in column.split("."):
        if not isinstance(value, dict) or key not in value:
            raise DataError(f"row {i + 1}: {column}: missing")
        value = value[key]
    # bool is an int: evaluate's `correct` counts as 1 or 0.
    if not isinstance(value, (int, float)) or value != value:
        raise DataError(f"row {i + 1}: {column}: expected a number, got {value!r}")
    return float(value)


class Difficulty(Selector):
    """Keep prompts with a pass rate strictly between `min_pass` and `max_pass` (neither always nor never solved).

    The rate is a row's `column`, or, with `group_by`, the mean of `column` over the rows sharing a value of
    `group_by`: on an `evaluate` stage's samples (`column: correct, group_by: prompt`) each prompt's share of
    correct completions, as Kimi k1.5 (2025) curates prompts by the pass rate of 10 samples. LIMO (Ye et al.
    2025) keeps problems a strong model solves 1 to 3 times in 32: `min_pass: 0.03125, max_pass: 0.09375,
    strict: false`.
    """

    class Config(PluginConfig):
        column: str = "pass_rate"  # the rate, 0 to 1; with group_by, averaged over the group (`correct` per sample)
        group_by: str | None = None  # None: each row carries its own rate
        # keep rows whose rate is above this (at or above with strict: false)
        min_pass: float = Field(0.0, ge=0.0, le=1.0)
        # keep rows whose rate is below this (at or below with strict: false)
        max_pass: float = Field(1.0, ge=0.0, le=1.0)
        strict: bool = True  # exclude the bounds themselves; the default [0, 1] then drops 0 and 1 only
        rate_key: str = "pass_rate"  # with group_by, each kept row gets its group's rate under this key

        @model_validator(mode="after")
        def _ordered(self):
            if self.max_pass < self.min_pass:
                raise ValueError(f"max_pass ({self.max_pass}) is below min_pass ({self.min_pass})")
            return self

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        cfg = self.config
        rates = [number(row, cfg.column, i) for i, row in enumerate(rows)]
        if cfg.group_by is not None:
            rates = self._group_means(rows, rates)
        kept = []
        for row, rate in zip(rows, rates):
            inside = cfg.min_pass < rate < cfg.max_pass if cfg.strict else cfg.min_pass <= rate <= cfg.max_pass
            if inside:
                kept.append({**row, cfg.rate_key: rate} if cfg.group_by is not None else row)
        return kept

    def _group_means(self, rows: list[dict], values: list[float]) -> list[float]:
        """Each row's group mean of `values`; rows missing `group_by` are an error, not one group."""
        sums: dict[str, list[float]] = {}
        keys = []
        for i, (row, value) in enumerate(zip(rows, values)):
            if self.config.group_by not in row:
                raise DataError(f"row {i + 1}: {self.config.group_by}: missing")
            key = str(row[self.config.group_by])
            total = sums.setdefault(key, [0.0, 0.0])
            total[0] += value
            total[1] += 1
            keys.append(key)
        return [sums[k][0] / sums[k][1] for k in keys]


@hookimpl
def register_selectors(register):
    register("difficulty", Difficulty)
