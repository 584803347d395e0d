"""Length filter: keep rows whose text columns are between `min` and `max` characters long."""

from __future__ import annotations

import random

from pydantic import Field, field_validator, model_validator

from alignflow.core import DataError, PluginConfig, Selector, hookimpl


class LengthSelector(Selector):
    """Keep rows whose `columns` each (or, with `total`, together) hold `min` to `max` characters.

    Characters, not tokens: a selector sees only rows, and a `select` stage has no model or tokenizer.
    With the tiny task's character tokenizer an ASCII character is one token.
    """

    class Config(PluginConfig):
        columns: list[str] = Field(default_factory=lambda: ["prompt"], min_length=1)  # e.g. [prompt, completion]
        min: int = Field(0, ge=0)  # inclusive
        max: int | None = Field(None, ge=0)  # inclusive; None: no upper bound
        total: bool = False  # bound the summed length of the columns instead of each one
        missing_ok: bool = False  # a row without a column is dropped rather than an error

        @field_validator("columns", mode="before")
        @classmethod
        def _one_column(cls, value):
            return [value] if isinstance(value, str) else value  # `columns: completion` in YAML

        @model_validator(mode="after")
        def _ordered(self):
            if self.max is not None and self.max < self.min:
                raise ValueError(f"max ({self.max}) is below min ({self.min})")
            return self

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        cfg = self.config
        upper = cfg.max if cfg.max is not None else float("inf")
        kept = []
        for i, row in enumerate(rows):
            lengths = self._lengths(row, i)
            if lengths is None:
                continue
            if cfg.total:
                lengths = [sum(lengths)]
            if all(cfg.min <= n <= upper for n in lengths):
                kept.append(row)
        return kept

    def _lengths(self, row: dict, i: int) -> list[int] | None:
        """Each column's length in characters; None when a column is missing and `missing_ok`."""
        lengths = []
        for column in self.config.columns:
            if column not in row:
                if self.config.missing_ok:
                    return None
                raise DataError(f"row {i + 1}: {column}: missing (set missing_ok to drop such rows)")
            value = row[column]
            if not isinstance(value, str):
                raise DataError(f"row {i + 1}: {column}: expected a string, got {type(value).__name__}")
            lengths.append(len(value))
        return lengths


@hookimpl
def register_selectors(register):
    register("length", LengthSelector)
