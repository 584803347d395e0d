"""Column-value filter: keep rows whose column equals a value or is in a set of values."""

from __future__ import annotations

import random
from typing import Any

from pydantic import model_validator

from alignflow.core import DataError, PluginConfig, Selector, hookimpl


class ColumnFilter(Selector):
    """Keep rows where `column` equals `equals`, or is one of `in_` (YAML key `in`)."""

    class Config(PluginConfig):
        column: str
        equals: Any = None
        in_: list[Any] | None = None
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
            if (self.equals is None) == (self.in_ is None):
                raise ValueError("give exactly one of 'equals' or 'in'")
            return self

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        cfg = self.config
        wanted = [cfg.equals] if cfg.in_ is None else cfg.in_
        kept = []
        for i, row in enumerate(rows):
            if cfg.column not in row and not cfg.missing_ok:
                raise DataError(f"row {i + 1}: {cfg.column}: missing (set missing_ok to skip such rows)")
            if (row.get(cfg.column, _MISSING) in wanted) != cfg.invert:
                kept.append(row)
        return kept


_MISSING = object()


@hookimpl
def register_selectors(register):
    register("column_filter", ColumnFilter)
