"""The environment contract: multi-turn episodes in which the model writes turns and the environment answers.

One instance per episode. `reset` starts it from a dataset row and a seed and returns the first messages;
`step` takes each model turn (its text and parsed tool calls) and returns what the environment says back, a
reward for the turn and whether the episode is over; `close` releases what it held. `reset`, `step` and
`close` may be `async def`: the episodes of a batch run concurrently either way (sync ones in threads), on one
event loop for the whole batch, so a connection an async `reset` opens serves its `step`s and `close`.
What the episodes of a batch share (a server they all connect to) comes from the class's `batch`.

The default `step` serves the common case, a task with tools: a turn with tool calls gets their results
(an error observation for a malformed call, an unknown tool or one that raises, never an exception) and
the episode goes on; a turn without any is the final answer, scored by `score`. The tools are `tools()` and
those of the MCP servers the stage declares or `mcp_servers()` names, started once per batch of episodes.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Iterator

from alignflow.core.contracts import PluginConfig
from alignflow.core.environments.tools import Message, ToolCall, call_tools
from alignflow.core.errors import AlignflowError

if TYPE_CHECKING:
    from alignflow.core.environments.mcp import McpServer


class EpisodeError(AlignflowError):
    """An environment broke its contract where no episode can go on (a failing `reset`, an MCP server that does
    not start)."""


@dataclass
class Turn:
    """One model turn: its text (special tokens removed), the tool calls parsed from it, its place (0 first)."""

    text: str
    tool_calls: list[ToolCall]
    index: int


@dataclass
class Step:
    """The environment's answer to a turn: messages to append (none when it ends), a reward, whether it is over.

    `observation` is a string (one user message) or a list of messages (`role` "tool" for tool results).
    `tool_calls` and `tool_errors` count what this turn asked of tools, for the episode's metrics.
    """

    observation: str | list[Message] | None = None
    reward: float = 0.0
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    info: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base for environment plugins: override `reset` and `score` (and `tools`), or `step` for any protocol."""

    Config: ClassVar[type[PluginConfig]] = PluginConfig
    mcp_tools: tuple = ()  # the batch's MCP servers' tools, set before `reset` (core/environments/mcp.py)

    def __init__(self, config: PluginConfig | None = None):
        self.config = config if config is not None else self.Config()

    @classmethod
    @contextmanager
    def batch(cls, config: PluginConfig) -> Iterator[Callable[[], "Environment"]]:
        """Held while one batch of episodes is played (entered before the first instance is made, left after
        the last has closed, also on failure); yields what makes each episode's instance. Override it for what
        the episodes share, such as a server they connect to."""
        yield lambda: cls(config)

    def reset(self, row: dict, seed: int) -> str | list[Message]:
        """Start an episode on dataset row `row`: its first messages (a string is one user message)."""
        return row["prompt"]

    def tools(self) -> list[Callable[..., Any]]:
        """Functions the model may call; each one's JSON schema comes from its signature and docstring."""
        return []

    def mcp_servers(self) -> list["McpServer"]:
        """MCP servers whose tools this environment's episodes get beside `tools()`, with the stage's `mcp` list;
        asked once per batch of episodes, which shares them."""
        return []

    def all_tools(self) -> list[Callable[..., Any]]:
        """`tools()` and the MCP servers' tools: what the model is shown and the default `step` calls."""
        return [*self.tools(), *self.mcp_tools]

    def step(self, turn: Turn) -> Step:
        """Run the turn's tool calls and go on; a turn without tool calls is the answer: `score` it and end."""
        if not turn.tool_calls:
            return Step(reward=float(self.score(turn.text)), done=True)
        results, errors = call_tools(self.all_tools(), turn.tool_calls)
        return Step(observation=results, tool_calls=len(turn.tool_calls), tool_errors=errors)

    def score(self, answer: str) -> float:
        """The reward of the final answer (the last turn's text)."""
        return 0.0

    def close(self) -> None:
        """The episode is over (or failed): release what it holds."""
