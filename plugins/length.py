"""length reward: a linear penalty on length beyond a target."""

from __future__ import annotations

from pydantic import Field

from alignflow.core import PluginConfig, hookimpl
from alignflow.core.rewards import completion_lengths


class LengthPenalty:
    """Length penalty: -coefficient * max(0, length - target) / target (0 at or under the target).

    Lengths are tokens from a `completion_lengths` or `completion_ids` column, else characters.
    """

    class Config(PluginConfig):
        target: int = Field(512, gt=0, description="length that costs nothing")
        coefficient: float = Field(1.0, ge=0, description="penalty per target-length of excess")

    def __init__(self, config: Config | None = None):
        self.config = config or self.Config()

    def __call__(self, prompts: list[str], completions: list[str], **columns) -> list[float | None]:
        target, coef = self.config.target, self.config.coefficient
        return [-coef * max(0, n - target) / target for n in completion_lengths(completions, columns)]


@hookimpl
def register_rewards(register):
    register("length", LengthPenalty)
