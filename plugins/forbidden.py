"""forbidden cost: occurrences of forbidden strings beyond a budget, C <= 0 when a completion keeps to it."""

from __future__ import annotations

from pydantic import Field, field_validator

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rewards import Scores


class Forbidden:
    """A cost for constrained RL (`repo`'s cost_reward): C = (occurrences of any of `strings`) - `budget`.

    Occurrences are counted per string, without overlaps (str.count), and summed over the strings; C <= 0 is
    safe. Listed as a reward with weight 0 it is measured and never optimised; the count of completions with
    C > 0 is logged beside its mean as `reward/<label>/violated`, so violation rate = violated / completions.
    """

    class Config(PluginConfig):
        strings: list[str] = Field(min_length=1, description="the forbidden strings")
        budget: float = Field(0.0, ge=0.0, description="occurrences allowed before C > 0 (0: none)")
        where: str | None = Field(None, description="a boolean column: the constraint binds only rows where it "
                                                    "is true (None: every row)")

        @field_validator("strings")
        @classmethod
        def _non_empty(cls, strings: list[str]) -> list[str]:
            if any(not s for s in strings):
                raise ValueError("an empty string occurs everywhere: every forbidden string needs a character")
            return strings

    def __init__(self, config: Config):
        self.config = config

    def cost(self, completion: str) -> float:
        return float(sum(completion.count(s) for s in self.config.strings)) - self.config.budget

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> Scores:
        binds = [True] * len(completions)
        if self.config.where is not None:
            binds = columns.get(self.config.where)
            if binds is None:
                raise ValueError(f"forbidden: where={self.config.where!r} names no column of the dataset "
                                 f"(columns: {sorted(columns)}); expected a boolean column marking the rows "
                                 "the constraint binds")
            if not all(isinstance(b, bool) for b in binds):
                raise ValueError(f"forbidden: column {self.config.where!r} holds {binds!r}; expected true/false")
        costs = [self.cost(c) if b else -self.config.budget for c, b in zip(completions, binds)]
        return Scores(costs, {"violated": float(sum(c > 0 for c in costs))})


@hookimpl
def register_rewards(register):
    register("forbidden", Forbidden)
