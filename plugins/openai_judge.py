"""openai_judge reward: an LLM behind any OpenAI-compatible server (vLLM, SGLang, a hosted API) judges each
completion at temperature 0; its reply is parsed into a score.

One POST to `{base_url}/chat/completions` per sample, `{"model": ..., "messages": [...], "temperature": 0,
"max_tokens": ...}`; the score is parsed from `choices[0].message.content`. Timeouts, retries and the failure
policy are the `remote` reward's (core/remote.py): a request that fails costs only its sample, None, counted.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

from pydantic import Field, field_validator

from alignflow.core import hookimpl
from alignflow.core.contracts import operational
from alignflow.core.remote import Failed, Poster, RemoteOptions, http_url, lose, new_counts, report
from alignflow.core.rewards import Scores
from alignflow.plugins.judge import last_score, placeholders

TEMPLATE = (
    "Question: {prompt}\nReference answer: {answer}\nResponse: {completion}\n"
    "Is the response correct? Reply with one word: yes or no."
)
BUILTIN = {"prompt", "completion"}  # the other placeholders name dataset columns


class OpenAIJudge:
    """LLM-as-a-judge over the OpenAI chat API: a verdict word (`parse` a mapping) or a number (`parse` a
    regex whose group 1 is the score), the last one in the reply; a reply with none is None (`unparsed`)."""

    class Config(RemoteOptions):
        base_url: str = operational(description="the server, e.g. http://judge-host:8000/v1 (`/v1` is added "
                                    "when missing)")
        model: str = Field(description="the model name the server serves: enters the stage digest")
        version: str = Field("", description="change it when the weights behind `model` change, to rerun stages")
        template: str = Field(TEMPLATE, description="the user message: {prompt}, {completion} and dataset "
                              "columns as {name}; literal braces doubled")
        system: str | None = None  # a system message before the template, if any
        parse: str | dict[str, float] = Field(
            default_factory=lambda: {"yes": 1.0, "no": 0.0},
            description="a regex whose group 1 is the score, or verdict word -> score (case-insensitive)")
        max_tokens: int = Field(512, ge=1, description="the judge's reply budget")

        @field_validator("base_url")
        @classmethod
        def _url(cls, v: str) -> str:
            return http_url(v)

        @field_validator("template")
        @classmethod
        def _template(cls, v: str) -> str:
            names = placeholders(v)
            if "completion" not in names:
                raise ValueError("the template never shows the judge the completion: add {completion}")
            odd = sorted(n for n in names if not n.isidentifier())
            if odd:
                raise ValueError(f"placeholders {odd}: expected {{prompt}}, {{completion}} or a column name")
            return v

        @field_validator("parse")
        @classmethod
        def _parse(cls, v):
            if isinstance(v, str):
                try:
                    groups = re.compile(v).groups
                except re.error as exc:
                    raise ValueError(f"{v!r} is not a regex: {exc}") from None
                if groups < 1:
                    raise ValueError(f"regex {v!r} needs a capture group for the score")
            elif not v:
                raise ValueError("expected at least one verdict word")
            return v

    def __init__(self, config: Config):
        self.config = c = config
        self.headers = c.request_headers(f"reward openai_judge ({c.model})")
        base = c.base_url.rstrip("/")
        self.url = (base if base.endswith("/v1") else base + "/v1") + "/chat/completions"
        self.columns = sorted(placeholders(c.template) - BUILTIN)
        if isinstance(c.parse, str):
            self.pattern, self.verdicts = re.compile(c.parse, re.IGNORECASE), None
        else:
            self.verdicts = {k.lower(): v for k, v in c.parse.items()}
            words = "|".join(re.escape(w) for w in sorted(self.verdicts, key=len, reverse=True))
            self.pattern = re.compile(rf"(?<!\w)({words})(?!\w)", re.IGNORECASE)

    def parse(self, reply: str) -> float | None:
        """The score of the last verdict (or number) in the reply; None when there is none."""
        return last_score(self.pattern, self.verdicts, reply)

    def render(self, prompts: list[str], completions: list[str], columns: dict[str, Any]) -> list[str]:
        """The user message of each sample; a template column missing from the batch is the pipeline's error."""
        missing = [name for name in self.columns if name not in columns]
        if missing:
            raise KeyError(f"reward openai_judge: template placeholders {missing} are not columns of the batch; "
                           f"it has {sorted(columns)}")
        n, texts = len(prompts), []
        for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
            row = {}
            for name in self.columns:  # a column that is not one value per sample is the same for all
                value = columns[name][i] if isinstance(columns[name], (list, tuple)) and len(columns[name]) == n \
                    else columns[name]
                row[name] = "" if value is None else value
            texts.append(self.config.template.format(prompt=p, completion=c, **row))
        return texts

    async def ask(self, poster: Poster, i: int, text: str, counts: dict[str, float], problems) -> str | None:
        """The judge's reply to one sample; None (counted) when the request or its reply failed."""
        c = self.config
        messages = ([{"role": "system", "content": c.system}] if c.system else []) + [{"role": "user", "content": text}]
        body = {"model": c.model, "messages": messages, "temperature": 0, "max_tokens": c.max_tokens}
        try:
            reply = await poster.post(self.url, body, counts)
            try:
                content = reply["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                raise Failed("malformed", f"no choices[0].message.content in {str(reply)[:200]}") from None
            if not isinstance(content, str):
                raise Failed("malformed", f"choices[0].message.content is {content!r}, not text")
            return content
        except Failed as exc:
            lose(counts, 1, exc, problems, f"sample {i}")
            return None

    async def __call__(self, prompts: list[str], completions: list[str], **columns) -> Scores:
        texts = self.render(prompts, completions, columns)
        counts, problems = new_counts("unparsed"), []
        async with Poster(self.config, self.headers) as poster:
            replies = await asyncio.gather(*(self.ask(poster, i, t, counts, problems) for i, t in enumerate(texts)))
        report(f"openai_judge ({self.config.model} at {self.url})", counts, len(texts), problems)
        values = [None if r is None else self.parse(r) for r in replies]
        counts["unparsed"] = float(sum(r is not None and v is None for r, v in zip(replies, values)))
        return Scores(values, counts)


@hookimpl
def register_rewards(register):
    register("openai_judge", OpenAIJudge)
