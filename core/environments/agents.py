"""Episodes driven from outside: the environment runs the episode and calls the policy through the endpoint.

An `AgentEnvironment` (an agent program written against the `openai` SDK, a verifiers environment, any harness)
gets a base URL of its own for each episode and calls the policy there as it likes; its `rollout` returns the
episode's reward. Meanwhile the calling thread serves the calls: it takes the calls waiting from every running
episode (a batch closes when every running episode has a call waiting, or `batch_wait_s` after its first call),
samples them in one sampler call, and answers them.
What the trainer gets is what the endpoint recorded (core/environments/recording.py): the prompt ids, sampled
ids and log-probs of every call, merged per episode while the calls extend each other.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field

from alignflow.core import seeds
from alignflow.core.contracts import PluginConfig
from alignflow.core.environments.contract import ENDINGS, Environment, Limits, Step, check_failures
from alignflow.core.environments.endpoint import MODEL, Answer, RequestError, Server, app, in_thread
from alignflow.core.environments.recording import EpisodeLog, Refused, Sample
from alignflow.core.environments.tools import ToolFormat, tool_format
from alignflow.core.errors import AlignflowError
from alignflow.core.sampling import Generation

log = logging.getLogger(__name__)
# the default of `batch_wait_s`: a decode of a batch costs about as much as one of a single call on a CPU, so a call
# waits for the others rather than going alone; waiting for a quiet gap instead split batches on a loaded machine
BATCH_WAIT_S = 1.0
CLOSE_WAIT_S = 10.0  # after the episodes: how long the endpoint's thread may take to stop


@dataclass(frozen=True)
class Policy:
    """Where an episode reaches the policy: an OpenAI-compatible base URL of its own, and the model's name."""

    base_url: str
    model: str = MODEL
    api_key: str = "alignflow"  # the endpoint checks none; the SDK wants one

    def client(self, **kwargs):
        """An `openai.AsyncOpenAI` client on this episode's URL, with no retries of its own."""
        import httpx
        from openai import AsyncOpenAI

        http = httpx.AsyncClient(verify=_ssl_context(), trust_env=False, timeout=None)
        return AsyncOpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, http_client=http, **kwargs)

    def sync_client(self, **kwargs):
        """An `openai.OpenAI` client on this episode's URL, with no retries of its own."""
        import httpx
        from openai import OpenAI

        http = httpx.Client(verify=_ssl_context(), trust_env=False, timeout=None)
        return OpenAI(base_url=self.base_url, api_key=self.api_key, max_retries=0, http_client=http, **kwargs)

    def environ(self) -> dict[str, str]:
        """The variables the `openai` SDK reads (and OPENAI_MODEL, for programs that take their model from it)."""
        return {"OPENAI_BASE_URL": self.base_url, "OPENAI_API_KEY": self.api_key, "OPENAI_MODEL": self.model}


@functools.cache
def _ssl_context():
    """One SSL context for every episode's HTTP client: an OpenAI client builds its own otherwise, ~30-100 ms of
    CPU each (the certificates loaded). One client per episode, not one shared: httpx's pool scans every
    connection it holds on each request, which a batch of hundreds of episodes made the endpoint's main cost."""
    import ssl

    return ssl.create_default_context()


class AgentConfig(PluginConfig):
    timeout_s: float = Field(300.0, gt=0)  # an episode still running after this long ends as `timeout`
    batch_wait_s: float = Field(BATCH_WAIT_S, ge=0)  # the longest a call waits for other episodes' calls to batch with


class AgentEnvironment(Environment):
    """An environment that drives its own episode: `rollout(row, seed, policy)` (sync or `async def`) calls the
    policy at `policy.base_url` and returns the episode's reward (a float, a `Step` with `reward`, `success` and
    `info`, or a dict with `reward` and optionally `success`, `ended`). The stage's limits are `limits`."""

    Config: ClassVar[type[PluginConfig]] = AgentConfig

    def rollout(self, row: dict, seed: int, policy: Policy) -> Step | float:
        raise NotImplementedError


@dataclass
class _Call:
    """A call waiting for the sampler: the ids the model reads, its token cap, and where its answer goes."""

    context: list[int]
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def resolve(self, value) -> None:
        def put(f=self.future):
            if not f.done():
                (f.set_exception if isinstance(value, BaseException) else f.set_result)(value)
        # the episodes are over and their loop is closed: nobody waits for this answer
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(put)


class DrivenEpisodes:
    """One batch of driven episodes: the endpoint and the episodes on a thread of their own, the sampling here."""

    def __init__(self, spec, tokenizer, rows: list[dict], n: int, gen, seed: int, stop_ids):
        self.spec, self.tokenizer, self.gen, self.seed = spec, tokenizer, gen, seed
        self.rows, self.stop_ids = rows, set(stop_ids)
        self.index = [i for i in range(len(rows)) for _ in range(n)]
        self.fmt: ToolFormat = tool_format(spec.tool_format, tokenizer)
        self.budget = spec.budget(gen)
        self.logs = [EpisodeLog(tokenizer, self.fmt, spec.max_turns, self.budget) for _ in self.index]
        self.calls: queue.Queue[_Call] = queue.Queue()
        self.live = len(self.index)  # episodes whose rollout has not returned
        self.done = threading.Event()
        self.stopping = False  # set when the calling thread fails: the episodes are cancelled
        self.wait = getattr(spec.config, "batch_wait_s", BATCH_WAIT_S)

    def run(self, sampler) -> Generation:
        start = time.perf_counter()
        thread, out = in_thread(self._episodes)
        try:
            env_s = self._serve(sampler)
        except BaseException:  # the sampler failed or the stage is interrupted: the episodes stop with it
            self.stopping = True
            task = getattr(self, "task", None)
            if task is not None:
                self.loop.call_soon_threadsafe(task.cancel)
            raise
        finally:
            self.done.set()
            thread.join(CLOSE_WAIT_S)
        if "error" in out:
            raise AlignflowError(f"environment {self.spec.name!r}: the episodes' event loop failed: "
                                 f"{type(out['error']).__name__}: {out['error']}") from out["error"]
        outcomes = out["result"]
        check_failures(self.spec.name, [e for _, e, _ in outcomes], [info.get("error") for *_, info in outcomes])
        return self._generation(outcomes, time.perf_counter() - start, env_s)

    # --- the calling thread: batches of calls, sampled ---
    def _serve(self, sampler) -> float:
        """Sample the waiting calls in batches until every episode has returned; the seconds spent waiting."""
        batches, waited = 0, 0.0
        while True:
            t = time.perf_counter()
            try:
                first = self.calls.get(timeout=0.05)
            except queue.Empty:
                waited += time.perf_counter() - t
                if self.done.is_set():
                    return waited
                continue
            batch, deadline = [first], time.monotonic() + self.wait
            while len(batch) < self.live and (left := deadline - time.monotonic()) > 0:
                try:
                    batch.append(self.calls.get(timeout=left))
                except queue.Empty:
                    break
            waited += time.perf_counter() - t
            batch = [c for c in batch if not c.future.done()]  # a timed-out episode's call is not sampled
            if batch:
                self._sample(sampler, batch, seeds.turn(self.seed, batches))
                batches += 1

    def _sample(self, sampler, batch: list[_Call], seed: int) -> None:
        gen = self.gen.model_copy(update={"max_new_tokens": max(c.max_new for c in batch)})
        try:
            g = sampler.generate([c.context for c in batch], 1, gen, seed)
        except BaseException as exc:
            for c in batch:
                c.resolve(RequestError(500, f"the sampler failed: {type(exc).__name__}: {exc}", kind="server_error"))
            raise
        for k, c in enumerate(batch):
            ids = g.completion_ids[k][: c.max_new]
            c.resolve((ids, None if g.logprobs is None else g.logprobs[k][: len(ids)]))

    # --- the endpoint's thread: requests and episodes ---
    async def _episodes(self) -> list[tuple[float, str, dict]]:
        self.loop, self.task = asyncio.get_running_loop(), asyncio.current_task()
        server = Server(app(self._chat, self._complete))
        await server.start()
        try:
            if self.stopping:
                raise asyncio.CancelledError
            return await asyncio.gather(*(self._episode(i, server.url) for i in range(len(self.index))))
        finally:
            self.done.set()
            await server.stop()

    async def _episode(self, i: int, url: str) -> tuple[float, str, dict]:
        """One episode: its reward, why it ended and what it said in `info`."""
        env = self.spec.environment(self.spec.config)
        env.limits = Limits(self.spec.max_turns, self.budget)
        row = self.rows[self.index[i]]
        timeout = getattr(env.config, "timeout_s", AgentConfig().timeout_s)
        reward, ended, info = 0.0, "done", {}
        try:
            result = await asyncio.wait_for(_call(env.rollout, row, seeds.episode(self.seed, self.index[i]),
                                                  Policy(f"{url}/episodes/{i}/v1")), timeout)
            reward, info = _outcome(result)
            ended = self.logs[i].limit or info.get("ended", "done")
        except asyncio.TimeoutError:
            ended = "timeout"
            log.warning("environment %r: an episode ran past its %s s and was stopped", self.spec.name, timeout)
        except Exception as exc:  # the episode fails, not the stage (unless every one of the batch does)
            ended, info = self.logs[i].limit or "error", {"error": f"rollout raised {type(exc).__name__}: {exc}"}
            log.warning("environment %r failed on an episode; it ends: %s: %s", self.spec.name,
                        type(exc).__name__, exc)
        finally:  # also when the episodes are cancelled: an agent program is killed in its rollout
            self.live -= 1
            self.logs[i].closed = True  # later calls of this episode are refused
            try:
                await asyncio.wait_for(_call(env.close), timeout)
            except Exception as exc:
                log.warning("environment %r failed to close an episode: %s", self.spec.name, exc)
        return reward, ended, info

    def _episode_log(self, episode: str) -> EpisodeLog:
        if not episode.isdigit() or int(episode) >= len(self.logs):
            raise RequestError(404, f"no episode {episode!r} runs here", code="not_found")
        found = self.logs[int(episode)]
        if found.closed:
            raise RequestError(409, f"episode {episode} is over", code="episode_over")
        return found

    async def _chat(self, episode: str, body: dict) -> Answer:
        record = self._episode_log(episode)
        try:
            sample, context = record.chat(body["messages"], body["tools"])
        except Refused as exc:
            raise RequestError(400, str(exc), code=exc.why) from None
        ids, lps = await self._wait(sample, context, body)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        content, calls = text, []
        if body["tools"]:
            parsed = self.fmt.parse(text, {t["function"]["name"]: t for t in body["tools"]})
            calls = [{"id": f"call_{sample.turns}_{k}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
                     for k, c in enumerate(parsed) if c.error is None]
            if calls:
                content = self.fmt.call.sub("", text).strip() or None
        returned = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        record.answer(sample, ids, lps, text, returned)
        return self._answer(context, ids, lps, text, content, calls)

    async def _complete(self, episode: str, body: dict) -> Answer:
        record = self._episode_log(episode)
        try:
            sample, context = record.completion(body["prompt"])
        except Refused as exc:
            raise RequestError(400, str(exc), code=exc.why) from None
        ids, lps = await self._wait(sample, context, body)
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        record.answer(sample, ids, lps, text, None)
        return self._answer(context, ids, lps, text, text, [])

    async def _wait(self, sample: Sample, context: list[int], body: dict):
        cap = min(x for x in (self.gen.max_new_tokens, body.get("max_tokens"), body.get("max_completion_tokens"),
                              self.budget - len(sample.transcript.ids)) if x is not None)
        future = self.loop.create_future()
        self.calls.put(_Call(context, cap, future, self.loop))
        try:
            return await future
        except BaseException:
            sample.busy = False
            raise

    def _answer(self, context, ids, lps, text, content, calls) -> Answer:
        stopped = bool(ids) and ids[-1] in self.stop_ids
        finish = "tool_calls" if calls else ("stop" if stopped else "length")
        tokens = _Tokens(self.tokenizer, ids)  # decoded one by one only if the client asked for log-probs
        return Answer(context, ids, lps if lps is not None else [0.0] * len(ids), tokens, text, content, calls, finish)

    # --- the result ---
    def _generation(self, outcomes: list[tuple[float, str, dict]], seconds: float, waited: float) -> Generation:
        """One row per recorded sample (an episode without any call: one empty row), in episode order."""
        rows: dict[str, list] = {k: [] for k in ("prompt_index", "prompt_ids", "ids", "mask", "lps", "truncated")}
        episodes: dict[str, list] = {k: [] for k in (
            "reward", "turns", "tool_calls", "tool_errors", "ended", "success", "messages", "turn_starts",
            "turn_history", "turn_observation", "sample", "final", "info")}
        has_lps = True
        for i, (record, (reward, ended, info)) in enumerate(zip(self.logs, outcomes)):
            samples = record.samples or [None]
            for k, s in enumerate(samples):
                t = s.transcript if s is not None else None
                ids = t.ids if t is not None else [self.tokenizer.eos_token_id]
                has_lps &= t is None or len(t.logprobs) == len(t.ids)
                rows["prompt_index"].append(self.index[i])
                rows["prompt_ids"].append(t.prompt_ids if t is not None else self._empty_prompt(i))
                rows["ids"].append(ids)
                rows["mask"].append(t.mask if t is not None else [0])
                rows["lps"].append(t.logprobs if t is not None else [0.0])
                rows["truncated"].append(ended in ("max_turns", "max_tokens", "timeout"))
                for key, value in (("reward", reward), ("turns", s.turns if s else 0),
                                   ("tool_calls", s.tool_calls if s else 0), ("tool_errors", 0), ("ended", ended),
                                   ("success", None if info.get("success") is None else bool(info["success"])),
                                   ("messages", record.messages), ("sample", k), ("final", k == len(samples) - 1),
                                   ("info", info)):
                    episodes[key].append(value)
                for key in ("turn_starts", "turn_history", "turn_observation"):
                    episodes[key].append(getattr(s, key) if s else [])
        return Generation(
            prompt_index=rows["prompt_index"], completion_ids=rows["ids"],
            texts=self.tokenizer.batch_decode(rows["ids"], skip_special_tokens=True), truncated=rows["truncated"],
            logprobs=rows["lps"] if has_lps else None,
            timings={"generate_s": seconds, "environment_s": waited}, prompt_ids=rows["prompt_ids"],
            loss_mask=rows["mask"], episodes=episodes)

    def _empty_prompt(self, i: int) -> list[int]:
        prompt = self.rows[self.index[i]].get("prompt")
        ids = self.tokenizer(prompt, add_special_tokens=False).input_ids if isinstance(prompt, str) else []
        return ids or [self.tokenizer.eos_token_id]


class _Tokens:
    """Each sampled id's text, decoded when first read."""

    def __init__(self, tokenizer, ids: list[int]):
        self.tokenizer, self.ids, self.texts = tokenizer, ids, None

    def __iter__(self):
        if self.texts is None:
            self.texts = [self.tokenizer.decode([t]) for t in self.ids]
        return iter(self.texts)


def _outcome(result) -> tuple[float, dict]:
    """A rollout's reward and info (`success` and `ended` in it when the rollout said them)."""
    if isinstance(result, Step):
        reward, info = float(result.reward), {**result.info, **({} if result.success is None
                                                               else {"success": result.success})}
    elif isinstance(result, dict):
        reward, info = float(result.get("reward", 0.0)), {k: v for k, v in result.items() if k != "reward"}
    else:
        reward, info = (0.0 if result is None else float(result)), {}
    if info.get("ended", "done") not in ENDINGS:
        raise ValueError(f"rollout returned ended {info['ended']!r}; expected one of {', '.join(ENDINGS)}")
    return reward, info


async def _call(fn, *args):
    """Await `fn(*args)`: a coroutine function on this loop, else in a thread of its own (`in_own_thread`)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args)
    return await in_own_thread(fn, *args)


async def in_own_thread(fn, *args):
    """Await sync `fn(*args)` run in a daemon thread of its own: a call that hangs past its episode's timeout is
    left behind, never waited for at exit (asyncio's pool would join it), and episodes never queue for threads."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run():
        try:
            value = fn(*args)
        except BaseException as exc:  # bound now: the name is unset once this block ends
            loop.call_soon_threadsafe(lambda error=exc: future.done() or future.set_exception(error))
            return
        loop.call_soon_threadsafe(lambda: future.done() or future.set_result(value))

    threading.Thread(target=run, daemon=True).start()
    return await future
