"""Token-in, token-out transcripts: the ids the trainer scores are the ids the sampler produced.

A transcript starts from the chat template's rendering of the first messages. Each model turn is appended
as the ids it was sampled as (never re-tokenised from its text); each environment reply is rendered by the
chat template and only the new text is tokenised, once. Re-tokenising the whole conversation each turn
would give other ids than were sampled (a merge across a turn's edge, a normalised space) and bias the
log-probs the trainer compares with the sampler's.

That needs a template that renders earlier turns the same when a turn is added; one that rewrites them
(drops earlier reasoning, say) is refused with an error naming the turn.
"""

from __future__ import annotations

import json

from typing import Any

from alignflow.core.environments.tools import Message
from alignflow.core.errors import AlignflowError


class TemplateError(AlignflowError):
    """The chat template cannot build a token-in, token-out transcript."""


def render(tokenizer, messages: list[Message], tools: list[dict] | None, generation_prompt: bool) -> str:
    """The chat template's text for `messages` (the tokenizer's own template; no template: contents joined)."""
    if not getattr(tokenizer, "chat_template", None):
        return "".join(m["content"] + (tokenizer.eos_token if m["role"] == "assistant" else "") for m in messages)
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=generation_prompt)


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


class Tokens:
    """Prompt ids, then the ids after it; `mask` is 1 on the model's tokens, `logprobs` 0 on the others."""

    def __init__(self, prompt_ids: list[int]):
        self.prompt_ids = prompt_ids
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []

    @property
    def context(self) -> list[int]:
        """What the model reads before its next turn."""
        return self.prompt_ids + self.ids

    def add_ids(self, ids: list[int], logprobs: list[float] | None = None, model: bool = False) -> None:
        """Sampled ids (`model`, with their log-probs) or context ids (no loss)."""
        self.ids += ids
        self.mask += [int(model)] * len(ids)
        self.logprobs += list(logprobs) if logprobs is not None else [0.0] * len(ids)


class Transcript(Tokens):
    """One episode's ids after its prompt, and the messages they stand for."""

    def __init__(self, tokenizer, messages: list[Message], tools: list[dict] | None = None):
        self.tokenizer, self.tools = tokenizer, tools
        self.messages = list(messages)
        self.rendered = render(tokenizer, self.messages, tools, True)  # the text the ids so far stand for
        super().__init__(encode(tokenizer, self.rendered))

    def add_turn(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        """A model turn, as sampled (its stop token included)."""
        self.add_ids(ids, logprobs, model=True)
        self.messages.append({"role": "assistant", "content": text})

    def reply_ids(self, reply: list[Message]) -> list[int]:
        """The ids of the environment's reply to the last turn, ready for the model's next turn."""
        eos = self.tokenizer.eos_token
        before = render(self.tokenizer, self.messages, self.tools, False)
        after = render(self.tokenizer, self.messages + list(reply), self.tools, True)
        turn = len([m for m in self.messages if m["role"] == "assistant"])
        if not before.startswith(self.rendered) or not after.startswith(before):
            raise TemplateError(
                f"the chat template renders earlier turns differently once turn {turn} is added, so the ids "
                "sampled so far would not be what the trainer scores; use a template that keeps earlier "
                "turns as they are (settings.chat_template)")
        at = before.rfind(eos, len(self.rendered))
        if at < 0:
            raise TemplateError(f"the chat template does not end an assistant turn with the EOS token {eos!r}: "
                                "the end of a sampled turn cannot be found in its rendering")
        # the template's text after the sampled stop token (Qwen's newline after <|im_end|>), then the reply
        return encode(self.tokenizer, before[at + len(eos):] + after[len(before):])

    def add_reply(self, reply: list[Message], ids: list[int]) -> None:
        """Append the reply `reply_ids` gave: context for the model, no loss."""
        self.add_ids(ids)
        self.messages += list(reply)
        self.rendered = render(self.tokenizer, self.messages, self.tools, True)


def as_messages(observation: str | list[Message] | Any) -> list[Message]:
    """An observation as messages: a string is one user message, a list holds `{"role", "content"}` messages
    (strings both); anything else is a TypeError saying what was expected, for the caller to name its source."""
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if not isinstance(observation, (list, tuple)):
        raise TypeError(f"got {type(observation).__name__} {_short(observation)}; expected a string (one user "
                        'message) or a list of {"role": str, "content": str} messages')
    for i, m in enumerate(observation):
        if not isinstance(m, dict) or not all(isinstance(m.get(k), str) for k in ("role", "content")):
            raise TypeError(f"item {i} of the list is {type(m).__name__} {_short(m)}; expected a "
                            '{"role": str, "content": str} message')
    return list(observation)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def replay(tokenizer, messages: list[Message], tools: list[dict] | None = None) -> Transcript:
    """The transcript an episode of this conversation would have: each assistant turn as its text's tokens and
    EOS (what a sampler returns for it), the messages between them (tool results in the tool-call format the
    template implies) rendered and tokenised once, and the `tools`' JSON schemas rendered where the template
    puts them, as an episode with those tools has them. What sft learns from a multi-turn conversation, so a
    model trained on a transcript sees the ids it would see playing the episode; messages after the last
    assistant turn are left out."""
    from alignflow.core.environments.tools import tool_format

    fmt = tool_format("auto", tokenizer)
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    transcript = Transcript(tokenizer, messages[:first], tools or None)
    i = first
    while i < len(messages):
        if messages[i]["role"] == "assistant":
            text = messages[i]["content"]
            transcript.add_turn(tokenizer(text, add_special_tokens=False).input_ids + [tokenizer.eos_token_id],
                                None, text)
            i += 1
            continue
        end = next((j for j in range(i, len(messages)) if messages[j]["role"] == "assistant"), len(messages))
        if end == len(messages):
            break
        reply = [fmt.result(m) if m["role"] == "tool" else m for m in messages[i:end]]
        transcript.add_reply(reply, transcript.reply_ids(reply))
        i = end
    return transcript


def row_tools(value) -> list[dict] | None:
    """A chat row's `tools` column: JSON function schemas, as a JSON string of a list (kept exactly, its nulls
    too, e.g. `"default": null`) or a list read from JSONL, whose null fields are dropped: Arrow fills a
    schema's missing keys with nulls to unite its fields with another schema's. None when there are none."""
    written = isinstance(value, str)
    if written:
        value = json.loads(value)
    if value is not None and not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    if not value:
        return None
    return value if written else [_without_nulls(t) for t in value]


def _without_nulls(value):
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value
