"""remote reward: scores from an HTTP scorer (a reward model or verifier served elsewhere), a batch per request.

`format: alignflow`, a POST to `url` with a JSON body:

    {"model": "MODEL", "prompts": ["1+1=", ...], "completions": ["2", ...], "columns": {"answer": ["2", ...]}}

(`columns` holds the listed `columns`, one value per sample), answered with one score per completion, in order:

    {"rewards": [1.0, null, ...]}

null is the scorer's "no opinion". `format: openrlhf` speaks OpenRLHF's `--remote_rm_url` protocol:
`{"query": [prompt + completion, ...], "prompts": [...], "labels": [...]}` (labels: the first listed column),
answered `{"rewards": [...]}`, `{"scores": [...]}` or a bare list. A reply of the wrong length is an error of
its whole batch; an entry that is not a finite number or null, of its sample. Either costs only those samples:
None for each, counted, as is a batch whose request failed after its retries (core/remote.py).
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal

from pydantic import Field, field_validator

from alignflow.core import hookimpl
from alignflow.core.contracts import operational
from alignflow.core.remote import Failed, Poster, RemoteOptions, http_url, lose, new_counts, number, report
from alignflow.core.rewards import Scores


class Remote:
    """Scores completions on an HTTP scorer, `batch_size` samples a request, `max_concurrency` requests at
    once; a batch the scorer fails on gives None for its samples, counted as `reward/NAME/failed`."""

    class Config(RemoteOptions):
        url: str = operational(description="the scorer's endpoint, e.g. http://rm-host:8000/get_reward")
        model: str = Field(description="the scorer's name, as you declare it: enters the stage digest")
        version: str = Field(description="the scorer's version: change it when the scorer changes, to rerun stages")
        columns: list[str] = Field(default_factory=list, description="dataset columns sent with each sample")
        format: Literal["alignflow", "openrlhf"] = "alignflow"  # the request and reply JSON (module docstring)
        batch_size: int = operational(32, ge=1, description="samples per request (a sample's score must not "
                                      "depend on its batch)")

        @field_validator("url")
        @classmethod
        def _url(cls, v: str) -> str:
            return http_url(v)

    def __init__(self, config: Config):
        self.config = config
        self.headers = config.request_headers(f"reward remote ({config.model})")

    def payload(self, prompts: list[str], completions: list[str], columns: dict[str, list]) -> dict:
        """One batch's request body in the configured format."""
        if self.config.format == "openrlhf":
            first = columns[self.config.columns[0]] if self.config.columns else [None] * len(prompts)
            return {"query": [p + c for p, c in zip(prompts, completions)], "prompts": prompts, "labels": first}
        return {"model": self.config.model, "prompts": prompts, "completions": completions, "columns": columns}

    def scores(self, reply: Any, n: int) -> list[Any]:
        """The reply's list of scores, checked for length; Failed (malformed) otherwise."""
        items = reply
        if isinstance(reply, dict):
            keys = ("rewards", "scores") if self.config.format == "openrlhf" else ("rewards",)
            items = next((reply[k] for k in keys if k in reply), None)
        elif self.config.format != "openrlhf":
            items = None  # a bare list is OpenRLHF's shape only
        if not isinstance(items, list):
            raise Failed("malformed", f"expected {{\"rewards\": [...]}}, got {str(reply)[:200]}")
        if len(items) != n:
            raise Failed("malformed", f"{len(items)} rewards for a batch of {n}")
        return items

    async def batch(self, poster: Poster, lo: int, prompts, completions, columns, values, counts, problems) -> None:
        """Score samples lo.. of the call into `values`; a failure costs only these samples."""
        n = len(prompts)
        try:
            reply = await poster.post(self.config.url, self.payload(prompts, completions, columns), counts)
            items = self.scores(reply, n)
        except Failed as exc:
            lose(counts, n, exc, problems, f"samples {lo}-{lo + n - 1}")
            return
        for i, item in enumerate(items):
            try:
                values[lo + i] = number(item)
            except Failed as exc:
                lose(counts, 1, exc, problems, f"sample {lo + i}")

    def sent_columns(self, columns: dict[str, Any], n: int) -> dict[str, list]:
        """The listed columns, one value per sample; a missing one is the pipeline's error, named."""
        out = {}
        for name in self.config.columns:
            if name not in columns:
                raise KeyError(f"reward remote: column {name!r} (config.columns) is not in the batch; "
                               f"it has {sorted(columns)}")
            value = columns[name]
            out[name] = list(value) if isinstance(value, (list, tuple)) and len(value) == n else [value] * n
        return out

    async def __call__(self, prompts: list[str], completions: list[str], **columns) -> Scores:
        n, size = len(prompts), self.config.batch_size
        sent = self.sent_columns(columns, n)
        values: list[float | None] = [None] * n
        counts, problems = new_counts(), []
        async with Poster(self.config, self.headers) as poster:
            await asyncio.gather(*(
                self.batch(poster, lo, prompts[lo:lo + size], completions[lo:lo + size],
                           {k: v[lo:lo + size] for k, v in sent.items()}, values, counts, problems)
                for lo in range(0, n, size)))
        report(f"remote ({self.config.model} at {self.config.url})", counts, n, problems)
        return Scores(values, counts)


@hookimpl
def register_rewards(register):
    register("remote", Remote)
