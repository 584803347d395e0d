"""overlong reward: DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13)."""

from __future__ import annotations

from pydantic import Field, model_validator

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rewards import completion_lengths


class Overlong:
    """DAPO's soft overlong punishment: 0 up to L_max - L_cache, then linear down to -1 at L_max.

    Lengths are tokens from a `completion_lengths` or `completion_ids` column, else characters.
    """

    class Config(PluginConfig):
        max_length: int = Field(20480, gt=0, description="L_max: the generation cap (DAPO: 20,480)")
        cache_length: int = Field(4096, gt=0, description="L_cache: the punished buffer (DAPO: 4,096)")

        @model_validator(mode="after")
        def _buffer_fits(self):
            if self.cache_length > self.max_length:
                raise ValueError(
                    f"cache_length ({self.cache_length}) must be <= max_length ({self.max_length})")
            return self

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def penalty(self, length: int) -> float:
        """R_length(|y|) of Eq. 13."""
        safe = self.config.max_length - self.config.cache_length
        if length <= safe:
            return 0.0
        if length <= self.config.max_length:
            return (safe - length) / self.config.cache_length
        return -1.0

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        return [self.penalty(n) for n in completion_lengths(completions, columns)]


@hookimpl
def register_rewards(register):
    register("overlong", Overlong)
