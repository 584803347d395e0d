"""An environment: guess a number from 1 to `high`, with a hint after each wrong guess."""

import random

from pydantic import Field

from alignflow.core import Environment, PluginConfig, Step, Turn


class Guess(Environment):
    """Guess a number from 1 to `high`: higher or lower after each wrong guess (-0.1), 1 for the right one."""

    class Config(PluginConfig):
        high: int = Field(10, ge=2)

    def reset(self, row, seed):
        self.secret = random.Random(seed).randint(1, self.config.high)
        return f"Guess my number from 1 to {self.config.high}. Answer with the number alone."

    def step(self, turn: Turn) -> Step:
        guess = int(turn.text.strip()) if turn.text.strip().isdigit() else None
        if guess == self.secret:
            return Step(reward=1.0, done=True, success=True)  # won: correct, whatever the wrong guesses cost
        hint = "not a number" if guess is None else ("higher" if guess < self.secret else "lower")
        return Step(observation=hint, reward=-0.1)
