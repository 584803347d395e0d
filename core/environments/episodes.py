"""Multi-turn rollouts: the sampler writes a turn for every running episode at once, the environments answer
concurrently, until each episode is over, reaches `max_turns`, or spends its token budget.

The result is an ordinary `Generation` whose completion is the whole episode after its prompt: the model's
turns as sampled and the environment's replies, with `loss_mask` 1 on the model's tokens only and the
sampler's log-probs on them (0 on the replies). Every consumer of a Generation (rewards, group advantages,
every RL loss through its response mask) works on episodes unchanged.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from alignflow.core import seeds
from alignflow.core.environments.agents import AgentEnvironment, DrivenEpisodes
from alignflow.core.environments.chat import Transcript, as_messages
from alignflow.core.environments.contract import (ENDINGS, Environment, EpisodeError, Limits, Step, Turn,
                                                  check_failures)
from alignflow.core.environments.mcp import McpServer, mcp_tools
from alignflow.core.environments.recording import state_hash
from alignflow.core.environments.tools import ToolFormat, tool_format, tool_schema
from alignflow.core.sampling import Generation

log = logging.getLogger(__name__)
# Per model turn of an episode: where it starts in the completion (a token offset), and state_hash of what
# the model had read before it: the whole context (prompt, earlier turns and replies) and the environment's
# latest observation alone (the first messages before turn 0, else the reply to the previous turn).
TURN_RECORDS = ("turn_starts", "turn_history", "turn_observation")


@dataclass
class Episodes:
    """How a stage runs episodes: the environment class and its validated config, and the limits."""

    environment: type[Environment]
    config: Any
    max_turns: int = 4
    max_tokens: int | None = None  # model and environment tokens after the prompt; None: max_turns x max_new_tokens
    tool_format: str = "auto"
    name: str = "environment"
    mcp: list[McpServer] = field(default_factory=list)  # MCP servers whose tools every episode gets
    _held: Any = field(default=None, init=False, repr=False, compare=False)  # `hold`'s instance maker

    @contextmanager
    def hold(self) -> Iterator["Episodes"]:
        """Keep what the environment's batches share (its `batch`: a server) for every `generate` call until the
        block ends, a stage's whole run rather than one round. A copy sent to another process holds its own."""
        with self.environment.batch(self.config) as make:
            self._held = make
            try:
                yield self
            finally:
                self._held = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_held": None}  # what is held lives in this process

    def budget(self, gen) -> int:
        """The most tokens an episode holds after its prompt."""
        return self.max_tokens if self.max_tokens is not None else self.max_turns * gen.max_new_tokens

    def generate(self, sampler, tokenizer, rows: list[dict], n: int, gen, seed: int) -> Generation:
        """`n` episodes per row (the `n` of a row start from the same seed), as one Generation."""
        if issubclass(self.environment, AgentEnvironment):  # it drives its episodes through the policy endpoint
            if self.mcp:
                raise EpisodeError(f"environment {self.name!r} drives its own episodes: it takes no MCP servers")
            stops = getattr(sampler, "stop_ids", None) or {tokenizer.eos_token_id}
            return DrivenEpisodes(self, tokenizer, rows, n, gen, seed, stops).run(sampler)
        start = time.perf_counter()
        fmt = tool_format(self.tool_format, tokenizer)
        index = [i for i in range(len(rows)) for _ in range(n)]
        batch = nullcontext(self._held) if self._held is not None else self.environment.batch(self.config)
        with batch as make, EventLoop() as loop:
            envs = [make() for _ in index]
            servers = [*self.mcp, *envs[0].mcp_servers()] if envs else []
            with mcp_tools(servers) as served:  # started for this batch, stopped however it ends
                try:
                    for env in envs:
                        env.mcp_tools, env.limits = tuple(served), Limits(self.max_turns, self.budget(gen))
                    firsts = loop.run([(env.reset, rows[i], seeds.episode(seed, i)) for env, i in zip(envs, index)])
                    firsts = [self._first(first, i, rows[i]) for i, first in zip(index, firsts)]
                    tools = tool_schemas(envs[0], self.name) if envs else {}  # alike in every episode
                    runs = [_Run(env, Transcript(tokenizer, first, list(tools.values()) or None), first)
                            for env, first in zip(envs, firsts)]
                    has_logprobs, env_s = self._turns(sampler, tokenizer, runs, gen, seed, fmt, tools, loop)
                finally:
                    for result in loop.run([(env.close,) for env in envs]):
                        if isinstance(result, BaseException):
                            log.warning("environment %r failed to close an episode: %s", self.name, result)
        check_failures(self.name, [r.ended for r in runs], [r.failure for r in runs])
        completions = [r.transcript.ids for r in runs]
        return Generation(
            prompt_index=index, completion_ids=completions,
            texts=tokenizer.batch_decode(completions, skip_special_tokens=True),
            truncated=[r.ended in ("max_turns", "max_tokens", "turn_tokens") for r in runs],
            logprobs=[r.transcript.logprobs for r in runs] if has_logprobs else None,
            timings={"generate_s": time.perf_counter() - start, "environment_s": env_s},
            prompt_ids=[r.transcript.prompt_ids for r in runs],
            loss_mask=[r.transcript.mask for r in runs],
            episodes={"reward": [r.reward for r in runs], "turns": [r.turns for r in runs],
                      "tool_calls": [r.tool_calls for r in runs], "tool_errors": [r.tool_errors for r in runs],
                      "ended": [r.ended for r in runs], "success": [r.success for r in runs],
                      "messages": [r.messages for r in runs],
                      **{k: [getattr(r, k) for r in runs] for k in TURN_RECORDS}},
            tools=list(tools.values()),  # the JSON schemas every episode was shown
        )

    def _first(self, first, i: int, row: dict) -> list:
        """What `reset` returned for row `i`, as messages; an exception or another type stops the stage, naming
        the row (no episode of it can be played)."""
        where = f"environment {self.name!r} failed to start an episode on row {i} ({_row_text(row)})"
        if isinstance(first, BaseException):
            raise EpisodeError(f"{where}: {type(first).__name__}: {first}") from first
        try:
            messages = as_messages(first)
        except TypeError as exc:
            raise EpisodeError(f"{where}: reset returned what is not a first message: {exc}") from None
        if not messages:
            raise EpisodeError(f"{where}: reset returned no message; expected at least one")
        return messages

    def _turns(self, sampler, tokenizer, runs: list["_Run"], gen, seed: int, fmt: ToolFormat,
               tools: dict, loop: "EventLoop") -> tuple[bool, float]:
        """Every episode's turns; whether the sampler gave log-probs, and the seconds spent in the environments.
        The sampler is told which episode each prompt continues (`continuing`: it may keep each one's KV cache
        between turns) and when an episode ends (`end_episodes`), however the turns end."""
        try:
            return self._play(sampler, tokenizer, runs, gen, seed, fmt, tools, loop)
        finally:
            sampler.end_episodes(runs)

    def _play(self, sampler, tokenizer, runs: list["_Run"], gen, seed: int, fmt: ToolFormat,
              tools: dict, loop: "EventLoop") -> tuple[bool, float]:
        """The turns themselves: each a `generate` call for every running episode, then their environments."""
        budget, has_logprobs, env_s = self.budget(gen), True, 0.0
        for turn in range(self.max_turns):
            active = [r for r in runs if r.ended is None]
            if not active:
                break
            left = budget - min(len(r.transcript.ids) for r in active)  # >= 1: a full episode has ended
            call = gen if left >= gen.max_new_tokens else gen.model_copy(update={"max_new_tokens": left})
            with sampler.continuing(active):  # an episode (a _Run) is its own key
                out = sampler.generate([r.transcript.context for r in active], 1, call, seeds.turn(seed, turn))
            has_logprobs &= out.logprobs is not None
            steps = []
            for k, r in enumerate(active):
                ids = out.completion_ids[k][: budget - len(r.transcript.ids)]
                lps = None if out.logprobs is None else out.logprobs[k][: len(ids)]
                text = tokenizer.decode(ids, skip_special_tokens=True)
                r.record_turn()
                r.transcript.add_turn(ids, lps, text)
                r.messages.append({"role": "assistant", "content": text})
                r.turns += 1
                if len(ids) < len(out.completion_ids[k]) or out.truncated[k]:
                    # no stop token (the episode's budget or max_new_tokens came first): unfinished, and so is
                    # the episode
                    r.ended = "max_tokens" if len(r.transcript.ids) >= budget else "turn_tokens"
                    continue
                steps.append((r, Turn(text, fmt.parse(text, tools), turn)))
            started = time.perf_counter()
            answers = loop.run([(r.env.step, t) for r, t in steps])
            env_s += time.perf_counter() - started
            for (r, _), answer in zip(steps, answers):
                r.take(answer, fmt, budget, turn + 1 == self.max_turns, self.name)
            sampler.end_episodes([r for r in active if r.ended is not None])
        return has_logprobs, env_s


class _Run:
    """One running episode."""

    def __init__(self, env: Environment, transcript: Transcript, first: list):
        self.env, self.transcript = env, transcript
        self.messages = list(first)  # the conversation as written (tool results unformatted): an sft row
        self.observation = list(first)  # the environment's latest observation, as messages
        self.reward, self.turns, self.tool_calls, self.tool_errors = 0.0, 0, 0, 0
        self.ended: str | None = None
        self.success: bool | None = None  # the environment's word on whether the episode was won (Step.success)
        self.failure: str | None = None  # why the environment failed, when it ended as `error`
        self.turn_starts: list[int] = []
        self.turn_history: list[int] = []
        self.turn_observation: list[int] = []

    def record_turn(self) -> None:
        """Where the next model turn starts, and hashes of the state it starts from (see TURN_RECORDS)."""
        self.turn_starts.append(len(self.transcript.ids))
        self.turn_history.append(state_hash(self.transcript.context))
        self.turn_observation.append(state_hash(self.observation))

    def take(self, answer: Step | BaseException, fmt: ToolFormat, budget: int, last: bool, name: str) -> None:
        """The environment's answer to the last turn: its reward, and its reply unless the episode is over."""
        said, problem = None, step_problem(answer)
        if problem is None and not (answer.done or answer.observation is None):
            try:
                said = as_messages(answer.observation)
            except TypeError as exc:
                problem = f"step returned an observation that is not messages: {exc}"
        if problem is not None:
            self.failure = f"environment {name!r}, turn {self.turns - 1}: {problem}"
            log.warning("%s; the episode ends", self.failure)
            self.ended = "error"
            return
        self.reward += float(answer.reward)
        self.tool_calls += answer.tool_calls
        self.tool_errors += answer.tool_errors
        self.success = self.success if answer.success is None else bool(answer.success)
        if said is None:
            self.ended = answer.info.get("ended", "done")  # an environment's own cap is not a finish
            if self.ended == "error":
                self.failure = f"environment {name!r}, turn {self.turns - 1}: step ended the episode as 'error'"
            return
        if last:
            self.ended = "max_turns"
            return
        reply = [fmt.result(m) if m.get("role") == "tool" else m for m in said]
        ids = self.transcript.reply_ids(reply)
        if len(self.transcript.ids) + len(ids) >= budget:  # no room for the reply and a turn after it
            self.ended = "max_tokens"
            return
        self.transcript.add_reply(reply, ids)
        self.messages += said
        self.observation = said


def step_problem(answer) -> str | None:
    """What keeps `step`'s return (or the exception it raised) from being a valid `Step`; None if it is one."""
    if isinstance(answer, BaseException):
        return f"step raised {type(answer).__name__}: {answer}"
    if not isinstance(answer, Step):
        return f"step returned {type(answer).__name__}; expected a Step"
    if not isinstance(answer.info, dict):
        return f"step returned a Step whose info is {type(answer.info).__name__}; expected a dict"
    ended = answer.info.get("ended", "done")
    if (answer.done or answer.observation is None) and ended not in ENDINGS:
        return f"step returned info['ended'] = {ended!r}; expected one of {', '.join(ENDINGS)}"
    try:
        float(answer.reward)
    except (TypeError, ValueError):
        return f"step returned reward {answer.reward!r}; expected a number"
    return None


class EventLoop:
    """An event loop in a thread of its own, held for a whole batch of episodes: what an async `reset` opens (a
    connection) is bound to the loop it was opened on, so every `step` and `close` of the batch runs there too.
    Its own thread, so a caller inside a running loop (a notebook) is served the same way."""

    def __enter__(self) -> "EventLoop":
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="episodes-loop", daemon=True)
        self.thread.start()
        return self

    def run(self, calls: list[tuple]) -> list[Any]:
        """Run `(fn, *args)` calls at once, async ones on the loop and sync ones in its threads; each result,
        or the exception it raised."""
        if not calls:
            return []
        future = asyncio.run_coroutine_threadsafe(_gather(calls), self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the calls are cancelled before anything after them runs
            raise

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(_shutdown(), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


async def _gather(calls: list[tuple]) -> list[Any]:
    async def one(fn: Callable, *args):
        if inspect.iscoroutinefunction(fn):
            return await fn(*args)
        return await asyncio.to_thread(fn, *args)

    return await asyncio.gather(*(one(*c) for c in calls), return_exceptions=True)


async def _shutdown() -> None:
    """What `asyncio.run` does before it closes its loop: cancel what is left, then end generators and threads."""
    loop, me = asyncio.get_running_loop(), asyncio.current_task()
    left = [t for t in asyncio.all_tasks(loop) if t is not me]
    for task in left:
        task.cancel()
    await asyncio.gather(*left, return_exceptions=True)
    await loop.shutdown_asyncgens()
    await loop.shutdown_default_executor()


def concurrently(calls: list[tuple]) -> list[Any]:
    """`EventLoop.run` on a loop of its own, for calls that hold nothing between them."""
    with EventLoop() as loop:
        return loop.run(calls)


def tool_schemas(env: Environment, name: str) -> dict[str, dict]:
    """Tool name -> the JSON schema an episode of `env` is shown, for `all_tools()`; one name twice is an error."""
    schemas, sources = {}, {}
    for tool in env.all_tools():
        source = f"MCP server {tool.server.label}" if hasattr(tool, "server") else "its tools()"
        if tool.__name__ in schemas:
            raise EpisodeError(f"environment {name!r}: two tools are named {tool.__name__!r} "
                               f"(from {sources[tool.__name__]} and from {source}); keep one with `tools:`")
        schemas[tool.__name__], sources[tool.__name__] = tool_schema(tool), source
    return schemas


def _row_text(row: dict) -> str:
    text = repr(row.get("prompt", row))
    return text if len(text) <= 80 else text[:77] + "..."


def episode_metrics(episodes: dict[str, list]) -> dict[str, float]:
    """Per-episode means of turns, tool calls and tool errors (and of splits), and the share of episodes ended by
    each limit."""
    # driven episodes (core/environments/agents.py) have a row per sample: a call that did not extend the episode's
    # sequence split it; the counts are then summed over an episode's samples and its ending taken once
    final = episodes.get("final") or [True] * len(episodes["turns"])
    n = max(sum(final), 1)
    metrics = {f"episode/{k}": sum(episodes[k]) / n for k in ("turns", "tool_calls", "tool_errors")}
    metrics.update({f"episode/ended_{e}": sum(x == e for x, f in zip(episodes["ended"], final) if f) / n
                    for e in ENDINGS})
    if "final" in episodes:
        metrics["episode/splits"] = float(len(final) - sum(final)) / n
    # what a driven episode's harness reported beside its reward (a verifiers rubric's parts, say): numeric means
    infos = [i for i, f in zip(episodes.get("info") or [], final) if f]
    for key in sorted({k for i in infos for k, v in i.items() if _number(v)}):
        values = [i[key] for i in infos if _number(i.get(key))]
        metrics[f"episode/info/{key}"] = sum(values) / len(values)
    return metrics


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
