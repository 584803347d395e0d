"""textarena environment: the model plays one of TextArena's single-player text games, turn by turn, for the
game's own reward (https://github.com/LeonGuertler/TextArena)."""

from __future__ import annotations

import random
import threading
from typing import Any

from pydantic import Field

from alignflow.core import AlignflowError, PluginConfig, hookimpl
from alignflow.core.environments import Environment, Step, Turn

# TextArena games draw from the global `random` (a game's reset seeds it): calls into them hold this lock and
# swap in their episode's own state, so concurrent episodes stay reproducible and the process's stream is kept.
_RANDOM = threading.Lock()


def _textarena():
    try:
        import textarena
    except ImportError as exc:
        raise AlignflowError("environment 'textarena' needs the TextArena library: pip install textarena") from exc
    return textarena


class TextArena(Environment):
    """A TextArena game by id (config `env_id`, or a row's `env_id`): its messages in, the model's turns as moves."""

    libraries = ("textarena",)

    class Config(PluginConfig):
        env_id: str | None = None  # e.g. "GuessTheNumber-v0"; a row's `env_id` takes precedence
        kwargs: dict[str, Any] = Field(default_factory=dict)  # game arguments over the registered ones
        system_prompt: str | None = None  # a system message before the game's first message

    def __init__(self, config: PluginConfig | None = None):
        super().__init__(config)
        self.game = self.base = self.rng = None
        self.done = False

    def _call(self, fn, *args):
        with _RANDOM:
            outer = random.getstate()
            try:
                if self.rng is not None:
                    random.setstate(self.rng)
                out = fn(*args)
                self.rng = random.getstate()
                return out
            finally:
                random.setstate(outer)

    def reset(self, row: dict, seed: int) -> str | list[dict]:
        ta = _textarena()
        env_id = row.get("env_id") or self.config.env_id
        if not env_id:
            raise AlignflowError("environment 'textarena' needs a game: set config env_id or a row's env_id")
        if env_id not in ta.envs.registration.ENV_REGISTRY:
            raise AlignflowError(f"textarena has no game {env_id!r} (see textarena.envs.registration.ENV_REGISTRY)")
        self.game = ta.make(env_id, **self.config.kwargs)
        # observation wrappers re-send the whole history each turn; a chat needs only what is new, so messages
        # are read from the game itself while moves still go through its action wrappers (brackets added)
        self.base = self.game
        while isinstance(self.base, ta.Wrapper):
            self.base = self.base.env
        self.done, self.rng = False, random.Random(seed).getstate()  # reproducible even for a game that seeds nothing
        try:
            self._call(lambda: self.game.reset(num_players=1, seed=seed))
        except AssertionError as exc:  # how TextArena games refuse a player count
            raise AlignflowError(f"textarena game {env_id!r} cannot start with one player ({exc}): only "
                                 "single-player games can be played") from exc
        text = self._observe()
        if self.config.system_prompt is None:
            return text
        return [{"role": "system", "content": self.config.system_prompt}, {"role": "user", "content": text}]

    def _observe(self) -> str:
        """The game's messages since the last turn, less the echo of the model's own move."""
        ta = _textarena()
        player, messages = self.base.get_observation()
        if player != 0:
            raise AlignflowError(f"textarena game {self.base.env_id!r} waits on player {player}: only "
                                 "single-player games can be played (no opponent is run)")
        # games log a move as the game's message or the player's: with one player, every PLAYER_ACTION is ours
        return "\n".join(text for _, text, kind in messages if kind != ta.ObservationType.PLAYER_ACTION)

    def step(self, turn: Turn) -> Step:
        if self.game is None or self.done:
            raise AlignflowError("textarena episode is not running: reset it first")
        done, info = self._call(self.game.step, turn.text)
        if not done:
            return Step(observation=self._observe(), info=dict(info or {}))
        self.done = True
        rewards, game_info = self.game.close()  # a game's rewards are known only once it ends
        player = (game_info or {}).get(0, {})
        return Step(reward=float((rewards or {}).get(0, 0.0)), done=True,
                    info={"reason": player.get("reason"), "invalid_move": bool(player.get("invalid_move"))})

    def close(self) -> None:
        self.game = self.base = self.rng = None


@hookimpl
def register_environments(register):
    register("textarena", TextArena)
