"""Column-value filter: keep rows whose column equals a value, is in a set of values, or matches a regex."""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import model_validator

from alignflow.core import DataError, PluginConfig, Selector, hookimpl


class ColumnFilter(Selector):
    """Keep rows where `column` equals `equals`, is one of `in_` (YAML key `in`), or is a string
    that `matches` (a Python regex, matched in full)."""

    class Config(PluginConfig):
        column: str  # the column to test (required)
        equals: Any = None  # keep rows whose value equals this
        in_: list[Any] | None = None  # keep rows whose value is one of these (YAML key `in`)
        matches: str | None = None  # keep rows whose string value matches this Python regex in full
        invert: bool = False  # keep the rows that do NOT match instead
        missing_ok: bool = False  # a row without the column is a non-match rather than an error

        model_config = {"populate_by_name": True}

        @model_validator(mode="before")
        @classmethod
        def _alias_in(cls, data: Any) -> Any:
            # `in` is a Python keyword, so the YAML key maps onto the field `in_`.
            if isinstance(data, dict) and "in" in data:
                data = {**data, "in_": data["in"]}
                del data["in"]
            return data

        @model_validator(mode="after")
        def _one_condition(self):
            if sum(x is not None for x in (self.equals, self.in_, self.matches)) != 1:
                raise ValueError("give exactly one of 'equals', 'in' or 'matches'")
            if self.matches is not None:
                try:
                    re.compile(self.matches)
                except re.error as e:
                    raise ValueError(f"matches: {self.matches!r} is not a valid regex: {e}") from None
            return self

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        cfg = self.config
        wanted = [cfg.equals] if cfg.in_ is None else cfg.in_
        pattern = re.compile(cfg.matches) if cfg.matches is not None else None
        kept = []
        for i, row in enumerate(rows):
            if cfg.column not in row and not cfg.missing_ok:
                raise DataError(f"row {i + 1}: {cfg.column}: missing (set missing_ok to skip such rows)")
            value = row.get(cfg.column, _MISSING)
            if pattern is not None:
                if value is not _MISSING and not isinstance(value, str):
                    raise DataError(f"row {i + 1}: {cfg.column}: 'matches' needs a string, got {type(value).__name__}")
                hit = isinstance(value, str) and pattern.fullmatch(value) is not None
            else:
                hit = value in wanted
            if hit != cfg.invert:
                kept.append(row)
        return kept


_MISSING = object()


@hookimpl
def register_selectors(register):
    register("column_filter", ColumnFilter)
