"""OpenEnv servers built with openenv-core's own classes, for tests of the `openenv` environment.

`python -m helpers.openenv_server --port PORT` (from tests/) serves two environments in one process:

- at `/`, a number-guessing game: reset(seed, high) picks the number, each wrong guess (`message`) gets
  "higher" or "lower" and -0.1, the right one 1.0 and the end; "sleep S" sleeps S seconds first (a slow server);
- at `/tools`, an MCP environment with tools `add(a, b)` and `submit(answer)`: submitting 12 ends the
  episode with 1.0, any other answer with 0.0.

With OPENENV_TEST_PIDFILE set the server writes its pid there, so a test can kill it.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from typing import Any, Optional

# gradio serves only openenv's optional web UI, which these servers leave off; openenv-core imports it if it can,
# and that import is 7 of the 10 s a server takes to start on a busy 2-core machine
sys.modules.setdefault("gradio", None)

from fastmcp import FastMCP  # noqa: E402
from openenv.core.env_server.http_server import create_fastapi_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.mcp_environment import MCPEnvironment  # noqa: E402
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402
from pydantic import Field  # noqa: E402

SESSIONS = 16  # concurrent WebSocket sessions (episodes) each environment serves


class GuessAction(Action):
    message: str = Field(..., description="a guess: a whole number")


class GuessObservation(Observation):
    text: str = Field("", description="what the game says")
    guesses: int = Field(0, description="guesses so far")


class Guess(Environment):
    """Guess a number from 1 to `high`, with hints."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)
        self.secret, self.guesses = 0, 0

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, high: int = 10,
              **kwargs: Any) -> GuessObservation:
        self.secret, self.guesses = random.Random(seed).randint(1, high), 0
        self._state = State(episode_id=episode_id, step_count=0)
        return GuessObservation(text=f"Guess my number from 1 to {high}.")

    def step(self, action: GuessAction, timeout_s: Optional[float] = None, **kwargs: Any) -> GuessObservation:
        text = action.message.strip()
        if text.startswith("sleep "):
            time.sleep(float(text.split()[1]))
            return GuessObservation(text="awake", guesses=self.guesses, reward=0.0)
        self.guesses += 1
        self._state.step_count += 1
        guess = int(text) if text.isdigit() else None
        if guess == self.secret:
            return GuessObservation(text="right", guesses=self.guesses, reward=1.0, done=True)
        hint = "not a number" if guess is None else ("higher" if guess < self.secret else "lower")
        return GuessObservation(text=hint, guesses=self.guesses, reward=-0.1)

    @property
    def state(self) -> State:
        return self._state


class Adder(MCPEnvironment):
    """Tools: add two numbers; submit the answer to 5 + 7."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        mcp = FastMCP("adder")

        @mcp.tool()
        def add(a: int, b: int) -> int:
            """Add two whole numbers."""
            return a + b

        @mcp.tool()
        def submit(answer: int) -> str:
            """Submit the final answer."""
            return "received"

        super().__init__(mcp)
        self._state = State(step_count=0)

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        self._state = State(episode_id=episode_id, step_count=0)
        return CallToolObservation(tool_name="", result="What is 5 + 7? Use the tools, then submit.")

    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        observation = await super().step_async(action, timeout_s=timeout_s, **kwargs)
        if isinstance(action, CallToolAction) and action.tool_name == "submit" and observation.error is None:
            observation.done, observation.reward = True, float(action.arguments.get("answer") == 12)
        return observation

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        raise ValueError(f"only tool calls are actions here, not {type(action).__name__}")

    @property
    def state(self) -> State:
        return self._state


def app():
    """Both environments in one FastAPI app: the game at `/`, the tools at `/tools`."""
    root = create_fastapi_app(Guess, GuessAction, GuessObservation, max_concurrent_envs=SESSIONS)
    root.mount("/tools", create_fastapi_app(Adder, CallToolAction, CallToolObservation,
                                            max_concurrent_envs=SESSIONS))
    return root


def main() -> None:
    import uvicorn

    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    if os.environ.get("OPENENV_TEST_PIDFILE"):
        with open(os.environ["OPENENV_TEST_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    uvicorn.run(app(), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
