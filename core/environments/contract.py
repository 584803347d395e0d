"""The environment contract: multi-turn episodes in which the model writes turns and the environment answers.

One instance per episode. `reset` starts it from a dataset row and a seed and returns the first messages;
`step` takes each model turn (its text and parsed tool calls) and returns what the environment says back, a
reward for the turn, whether the episode is over (and why, and whether it was won); `close` releases what it
held. The stage's limits on the episode (`max_turns`, its token budget) are `limits`, set before `reset`.
`reset`, `step` and `close` may be `async def`: the episodes of a batch run concurrently either way (sync ones
in threads), on one event loop for the whole batch, so a connection an async `reset` opens serves its `step`s
and `close`.
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


ENDINGS = ("done", "max_turns", "max_tokens", "turn_tokens", "error", "timeout")  # why an episode ended


class EpisodeError(AlignflowError):
    """An environment broke its contract where no episode can go on (a failing `reset`, an MCP server that does
    not start, every episode of a batch failing)."""


@dataclass(frozen=True)
class Limits:
    """The stage's limits on each episode (its `environment:` block), as the environment sees them."""

    max_turns: int = 4  # model turns; the episode ends as `max_turns` after the last
    max_tokens: int | None = None  # model and environment tokens after the prompt (None: not known here)


@dataclass
class Turn:
    """One model turn: its text (special tokens removed), the tool calls parsed from it, its place (0 first)."""

    text: str  # what the model wrote, special tokens removed
    tool_calls: list[ToolCall]  # the calls parsed from `text` (hermes or tag form, the stage's `tool_format`)
    index: int  # the turn's place in the episode: 0 for the first


@dataclass
class Step:
    """The environment's answer to a turn: messages to append (none when it ends), a reward, whether it is over.

    `observation` is a string (one user message), a list of `{"role", "content"}` messages (`role` "tool" for
    tool results) or None (the episode ends). `tool_calls` and `tool_errors` count what this turn asked of
    tools, for the episode's metrics. `success` says whether the episode was won, apart from its reward (None:
    not said; the episode then counts as correct when its reward is at least 1). `info["ended"]` on a `done`
    step says why it ended when not "done", as one of ENDINGS (an environment's own turn cap: "max_turns").
    """

    # the next messages: a string (one user message), a list of messages, or None
    observation: str | list[Message] | None = None
    reward: float = 0.0  # this turn's reward; the episode's reward is the sum over its turns
    done: bool = False  # the episode is over: no more model turns
    tool_calls: int = 0  # tool calls this turn made, for the episode's metrics
    tool_errors: int = 0  # of those, the ones that failed
    # free-form; `info["ended"]` on a done step says why it ended, one of ENDINGS
    info: dict[str, Any] = field(default_factory=dict)
    success: bool | None = None  # whether the episode was won, apart from its reward; None: reward >= 1 counts as won


def check_failures(name: str, ended: list[str], failures: list[str | None]) -> None:
    """A batch in which every episode ended in `error` stops the stage, as a reward that fails on every sample of
    a batch does: the environment, not the policy, is broken. `failures`: each episode's reason, if it failed."""
    if ended and all(e == "error" for e in ended):
        first = next((f for f in failures if f), "no reason recorded")
        raise EpisodeError(f"environment {name!r} failed on every episode of a batch of {len(ended)}; the first: "
                           f"{first}")


class Environment:
    """Base for environment plugins: override `reset` and `score` (and `tools`), or `step` for any protocol."""

    # the plugin's pydantic config, from the stage's `environment: {config: ...}`
    Config: ClassVar[type[PluginConfig]] = PluginConfig
    mcp_tools: tuple = ()  # the batch's MCP servers' tools, set before `reset` (core/environments/mcp.py)
    limits: Limits = Limits()  # the stage's limits on this episode, set before `reset`

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
        """The reward of the final answer: the text of the turn without tool calls (special tokens removed)."""
        return 0.0

    def close(self) -> None:
        """The episode is over (or failed): release what it holds."""
