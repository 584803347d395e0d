"""Rewards served over HTTP: the options every remote scorer shares, and one async POST with retries
(exponential backoff with jitter), a limit on requests in flight and failures recorded, never raised.

httpx is imported on first use only, so loading the plugins costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import random
import re
from typing import Any

from pydantic import field_validator
from pydantic_core import PydanticUndefined

from alignflow.core.contracts import PluginConfig, operational

log = logging.getLogger(__name__)
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# reward/<name>/<count>: samples lost (all reasons, then each), and requests asked again
COUNTS = ("failed", "timeout", "unreachable", "http_error", "malformed", "retries")
_jitter = random.Random()  # its own generator: the stage's seeded global `random` state is never drawn from


class RemoteOptions(PluginConfig):
    """How a remote reward reaches its server. None of it enters the stage digest: moving a scorer to
    another host, or giving it more time, reruns nothing."""

    timeout_s: float = operational(60.0, gt=0, description="one request's wall clock, connect to last byte; "
                                   "a request past it is given up, not retried")
    retries: int = operational(3, ge=0, description="further attempts after a connection error, a 5xx or a 429")
    backoff_s: float = operational(0.5, ge=0, description="wait before the first retry; doubled for each next "
                                   "one, plus up to as much again at random")
    max_backoff_s: float = operational(30.0, ge=0, description="the longest wait between attempts (a 429's "
                                       "Retry-After included)")
    max_concurrency: int = operational(8, ge=1, description="requests in flight at once")
    headers: dict[str, str] = operational(PydanticUndefined, default_factory=dict,
                                          description="extra HTTP headers (not the key: see api_key_env)")
    api_key_env: str | None = operational(None, description="NAME of the environment variable holding the API "
                                          "key, sent as `Authorization: Bearer KEY`; never the key itself")

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, v: str | None) -> str | None:
        if v is not None and not ENV_NAME.fullmatch(v):
            raise ValueError(f"expected the NAME of an environment variable holding the key (e.g. SCORER_API_KEY), "
                             f"got {v[:4]!r}...: a key does not belong in a pipeline file")
        return v

    @field_validator("headers")
    @classmethod
    def _no_key(cls, v: dict[str, str]) -> dict[str, str]:
        if any(k.lower() == "authorization" for k in v):
            raise ValueError("an Authorization header holds a key: put the key in an environment variable and "
                             "name it in `api_key_env`")
        return v

    def request_headers(self, where: str) -> dict[str, str]:
        """`headers`, plus the bearer token from `api_key_env`; an unset variable is an error now, not 401s later."""
        headers = dict(self.headers)
        if self.api_key_env is not None:
            key = os.environ.get(self.api_key_env)
            if not key:
                raise ValueError(f"{where}, config.api_key_env: environment variable {self.api_key_env} is not set")
            headers["Authorization"] = f"Bearer {key}"
        return headers


class Failed(Exception):
    """A request that brought back no usable answer; `kind` is one of COUNTS (timeout, unreachable, ...)."""

    def __init__(self, kind: str, message: str, retry: bool = False, wait: float | None = None):
        super().__init__(message)
        self.kind, self.retry, self.wait = kind, retry, wait  # retry: worth asking again; wait: the server's word


def http_url(value: str) -> str:
    """A config's server address: an http(s) URL, checked when the spec is, not at the first request."""
    if not re.match(r"https?://[^/\s]+", value):
        raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
    return value


def new_counts(*extra: str) -> dict[str, float]:
    return dict.fromkeys((*COUNTS, *extra), 0.0)


def lose(counts: dict[str, float], n: int, failure: Failed, problems: list[str], where: str) -> None:
    """Count `n` samples lost to `failure` under `failed` and under its kind; keep its message for `report`."""
    counts["failed"] += n
    counts[failure.kind] += n
    problems.append(f"{where}: {failure}")


def report(name: str, counts: dict[str, float], n: int, problems: list[str]) -> None:
    """One warning per call, not one per failed request: a scorer that is down would flood the log."""
    if problems:
        kinds = ", ".join(f"{k} {int(counts[k])}" for k in COUNTS[1:-1] if counts[k])
        log.warning("reward %s: %d of %d samples unscored (%s); first: %s", name, int(counts["failed"]), n, kinds,
                    problems[0])


def number(value: Any) -> float | None:
    """A reply's score: a finite JSON number, None for null; anything else (a string, true, NaN) is malformed."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise Failed("malformed", f"expected a finite number or null, got {value!r}")
    return float(value)


def retry_after(response) -> float | None:
    """A 429's or 503's `Retry-After` in seconds, when it gives seconds."""
    try:
        return max(0.0, float(response.headers.get("retry-after", "")))
    except ValueError:
        return None


class Poster:
    """One call's async HTTP client: every POST waits for one of `max_concurrency` slots, and a connection
    error, a 5xx or a 429 is asked again `retries` times."""

    def __init__(self, options: RemoteOptions, headers: dict[str, str]):
        self.options, self.headers = options, headers

    async def __aenter__(self) -> "Poster":
        import httpx

        o = self.options
        # a client per call: `RewardSet` runs each call in an event loop of its own, and a client is bound to one
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(o.timeout_s), headers=self.headers,
                                        limits=httpx.Limits(max_connections=o.max_concurrency))
        self.slots = asyncio.Semaphore(o.max_concurrency)
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    async def post(self, url: str, payload: Any, counts: dict[str, float]) -> Any:
        """The JSON reply to `payload`; raises Failed once the attempts are spent or the answer is final."""
        o = self.options
        problem = None
        for attempt in range(o.retries + 1):
            if problem is not None:
                counts["retries"] += 1
                backoff = o.backoff_s * 2 ** (attempt - 1) * (1 + _jitter.random())
                await asyncio.sleep(min(o.max_backoff_s, max(problem.wait or 0.0, backoff)))
            try:
                return await self._attempt(url, payload)
            except Failed as exc:
                if not exc.retry:
                    raise
                problem = exc
        raise Failed(problem.kind, f"{problem} (after {o.retries + 1} attempt{'s' if o.retries else ''})")

    async def _attempt(self, url: str, payload: Any) -> Any:
        import httpx

        o = self.options
        try:
            async with self.slots:  # held only while a request is in flight, never while backing off
                response = await asyncio.wait_for(self.client.post(url, json=payload), o.timeout_s)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.NetworkError, httpx.RemoteProtocolError) as exc:
            raise Failed("unreachable", f"{type(exc).__name__}: {exc}", retry=True) from None
        except (asyncio.TimeoutError, httpx.TimeoutException):
            # a scorer that hangs would cost every retry the whole timeout: it is given up at once
            raise Failed("timeout", f"no answer within timeout_s={o.timeout_s}") from None
        except httpx.TransportError as exc:  # a proxy's refusal, a protocol the URL's scheme does not speak
            raise Failed("unreachable", f"{type(exc).__name__}: {exc}") from None
        if response.status_code == 429 or response.status_code >= 500:
            raise Failed("http_error", f"HTTP {response.status_code}: {response.text[:200]}", retry=True,
                         wait=retry_after(response))
        if response.is_error:  # any other 4xx: the same request would get the same answer
            raise Failed("http_error", f"HTTP {response.status_code}: {response.text[:200]}")
        try:
            return response.json()
        except ValueError:
            raise Failed("malformed", f"the reply is not JSON: {response.text[:200]!r}") from None
