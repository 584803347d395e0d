"""Quality selection: the top-scored rows, at most `per_cluster` from each cluster of near-duplicates."""

from __future__ import annotations

import math
import random
import unicodedata

from pydantic import Field, model_validator

from alignflow.core import PluginConfig, Selector, hookimpl
from alignflow.plugins.difficulty import number


def near_duplicate_key(text: object) -> str:
    """Equal for texts that differ only in Unicode form, case or whitespace ("What is 2 + 2?" ~ "what is 2+2?")."""
    folded = unicodedata.normalize("NFKC", str(text)).casefold()
    return "".join(folded.split())


class Quality(Selector):
    """Keep the `k` (or `fraction` of) rows scored highest by `column`, at most `per_cluster` per prompt.

    LIMO's rule (Ye et al. 2025, "LIMO: Less is More for Reasoning"): rank question-solution pairs by a
    quality score and keep the top ones, one solution per question (817 pairs). LIMA (Zhou et al. 2023) argues
    the same for alignment: 1,000 diverse, high-quality examples. The score is a number already in the rows (a
    reward or judge score; `rewards.NAME` on an `evaluate` stage's samples); clusters are rows whose
    `cluster_column` is equal after Unicode normalisation, case folding and whitespace removal (coarser
    than `dedup`'s, which only strips; not fuzzy). Ties go to the earlier row; rows keep their input order.
    """

    class Config(PluginConfig):
        column: str = "score"  # higher is better
        k: int | None = Field(None, ge=1)  # LIMO kept 817, LIMA 1,000
        fraction: float | None = Field(None, gt=0.0, le=1.0)  # of the input rows, rounded down
        cluster_column: str | None = "prompt"  # None: no diversity cap; rows without it share one cluster
        per_cluster: int = Field(1, ge=1)  # rows kept at most from each cluster (rows sharing `cluster_column`)

        @model_validator(mode="after")
        def _one_budget(self):
            if (self.k is None) == (self.fraction is None):
                raise ValueError("give exactly one of 'k' or 'fraction'")
            return self

    def __call__(self, rows: list[dict], rng: random.Random) -> list[dict]:
        cfg = self.config
        scores = [number(row, cfg.column, i) for i, row in enumerate(rows)]
        # The epsilon keeps 0.3 * 10 = 3.0000000000000004 and 0.29 * 100 = 28.999999999999996 at 3 and 29.
        budget = cfg.k if cfg.k is not None else math.floor(cfg.fraction * len(rows) + 1e-9)
        order = sorted(range(len(rows)), key=lambda i: -scores[i])  # stable: ties keep input order
        taken: dict[str, int] = {}
        keep: list[int] = []
        for i in order:
            if len(keep) >= budget:
                break
            if cfg.cluster_column is not None:
                key = near_duplicate_key(rows[i].get(cfg.cluster_column, ""))
                if taken.get(key, 0) >= cfg.per_cluster:
                    continue
                taken[key] = taken.get(key, 0) + 1
            keep.append(i)
        return [rows[i] for i in sorted(keep)]


@hookimpl
def register_selectors(register):
    register("quality", Quality)
