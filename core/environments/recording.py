"""What the policy endpoint keeps of an episode: each call's exact prompt ids, sampled ids and log-probs.

Calls of one episode merge into one sequence while each call's prompt extends the last: the conversation the
client sends starts with the conversation so far, the model's turns as they were returned. The model's turns
then stay the ids the sampler drew (never re-tokenised from their text), and only the client's new messages
are rendered and tokenised, once, as in-process episodes do (core/environments/chat.py). A call that does not
extend (the harness rewrote, dropped or truncated history, changed the tools, or the template renders earlier
turns differently) starts a new sample of the same episode, counted; nothing is ever silently re-tokenised.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from alignflow.core.environments.chat import TemplateError, Tokens, Transcript, encode
from alignflow.core.environments.tools import Message, ToolFormat


class Refused(Exception):
    """An episode limit refuses the call: `why` is the episode's ending (max_turns, max_tokens)."""

    def __init__(self, why: str, message: str):
        super().__init__(message)
        self.why = why


class TextTranscript(Tokens):
    """A `/v1/completions` sample: the prompt's text and ids, then sampled ids and the client's added text."""

    def __init__(self, tokenizer, prompt: str | list[int]):
        self.tokenizer = tokenizer
        self.text = prompt if isinstance(prompt, str) else tokenizer.decode(prompt)
        super().__init__(list(prompt) if isinstance(prompt, list) else encode(tokenizer, prompt))

    def add_turn(self, ids: list[int], logprobs: list[float] | None, text: str) -> None:
        self.add_ids(ids, logprobs, model=True)
        self.text += text

    def extend(self, prompt: str | list[int]) -> bool:
        """Append what `prompt` adds to this sample's ids (as ids) or text (as text); False if it does not extend."""
        if isinstance(prompt, list):
            if prompt[: len(self.context)] != self.context:
                return False
            added = prompt[len(self.context):]
        else:
            if not prompt.startswith(self.text):
                return False
            added, self.text = encode(self.tokenizer, prompt[len(self.text):]), prompt
        self.add_ids(added)
        return True


@dataclass
class Sample:
    """One training row of an episode: a transcript, the conversation as the client sees it, turn records."""

    transcript: Any  # Transcript (chat calls) or TextTranscript (completions)
    said: list[Message] | None  # chat: the messages so far, the model's turns as returned to the client
    turns: int = 0
    tool_calls: int = 0
    busy: bool = False  # a call is being answered: another call cannot extend it yet
    turn_starts: list[int] = field(default_factory=list)
    turn_history: list[int] = field(default_factory=list)
    turn_observation: list[int] = field(default_factory=list)
    observation: Any = None  # the client's latest messages (or text) before the next turn


class EpisodeLog:
    """Every call of one episode, as samples; the limits of the stage's `environment:` block are enforced here."""

    def __init__(self, tokenizer, fmt: ToolFormat, max_turns: int, budget: int):
        self.tokenizer, self.fmt, self.max_turns, self.budget = tokenizer, fmt, max_turns, budget
        self.samples: list[Sample] = []
        self.calls = 0
        self.limit: str | None = None  # the limit that refused a call, if one did
        self.closed = False  # the episode has returned
        self.messages: list[Message] = []  # the conversation as last sent, with the last answer

    @property
    def splits(self) -> int:
        """Samples beyond the first: calls that did not extend the episode's sequence."""
        return max(len(self.samples) - 1, 0)

    def chat(self, messages: list[Message], tools: list[dict] | None) -> tuple[Sample, list[int]]:
        """The sample a chat call extends (or starts) and the ids the model reads."""
        self._check_turns()
        sample = self._extended_chat(messages, tools)
        if sample is None:
            first = [self._for_template(m) for m in messages]
            sample = Sample(Transcript(self.tokenizer, first, tools or None), [dict(m) for m in messages],
                            observation=messages)
            self.samples.append(sample)
        self.messages = [dict(m) for m in messages]
        return self._start_turn(sample)

    def completion(self, prompt: str | list[int]) -> tuple[Sample, list[int]]:
        """The sample a completions call extends (or starts) and the ids the model reads."""
        self._check_turns()
        last = self.samples[-1] if self.samples else None
        if last is None or last.said is not None or last.busy or not last.transcript.extend(prompt):
            last = Sample(TextTranscript(self.tokenizer, prompt), None)
            self.samples.append(last)
        last.observation = prompt
        return self._start_turn(last)

    def answer(self, sample: Sample, ids: list[int], logprobs: list[float] | None, text: str,
               returned: Message | None) -> None:
        """The sampled turn, as drawn; `returned` is the chat message the client got for it."""
        sample.transcript.add_turn(ids, logprobs, text)
        sample.turns += 1
        sample.busy = False
        if returned is not None:
            sample.said.append(returned)
            sample.tool_calls += len(returned.get("tool_calls") or [])
            self.messages.append(returned)

    def _check_turns(self) -> None:
        if self.calls >= self.max_turns:
            self.limit = "max_turns"
            raise Refused("max_turns", f"the episode has had its {self.max_turns} model turns (environment.max_turns)")
        self.calls += 1

    def _start_turn(self, sample: Sample) -> tuple[Sample, list[int]]:
        left = self.budget - len(sample.transcript.ids)
        if left <= 0:
            self.calls -= 1
            self.limit = "max_tokens"
            raise Refused("max_tokens", f"the episode's {self.budget} tokens are spent (environment.max_tokens)")
        sample.busy = True
        context = sample.transcript.context
        sample.turn_starts.append(len(sample.transcript.ids))
        sample.turn_history.append(state_hash(context))
        sample.turn_observation.append(state_hash(sample.observation))
        return sample, context

    def _extended_chat(self, messages: list[Message], tools: list[dict] | None) -> Sample | None:
        """The last sample, grown by the messages the client added after it; None if the call does not extend it."""
        last = self.samples[-1] if self.samples else None
        if last is None or last.said is None or last.busy or (tools or None) != last.transcript.tools:
            return None
        n = len(last.said)
        if len(messages) <= n or [_norm(m) for m in messages[:n]] != [_norm(m) for m in last.said]:
            return None
        added = messages[n:]
        if any(m.get("role") == "assistant" for m in added):
            return None  # a model turn the policy did not write: not the sampled ids
        reply = [self._for_template(m) for m in added]
        try:
            ids = last.transcript.reply_ids(reply)
        except TemplateError:
            return None
        last.transcript.add_reply(reply, ids)
        last.said += [dict(m) for m in added]
        last.observation = added
        return last

    def _for_template(self, message: Message) -> Message:
        """A client's message as the chat template renders it (tool results in the policy's tool format)."""
        out: Message = {"role": message["role"], "content": text_of(message.get("content"))}
        if message.get("tool_calls"):
            out["tool_calls"] = [{"type": "function", "function": {"name": c["function"]["name"],
                                                                   "arguments": _arguments(c["function"])}}
                                 for c in message["tool_calls"]]
        if message["role"] == "tool":
            out = self.fmt.result({**out, "name": message.get("name", "")})
        return out


def text_of(content) -> str:
    """A message's content as text: a string, the text parts of a list of parts, or '' for none."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def _arguments(function: dict) -> dict:
    args = function.get("arguments") or {}
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return {"_raw": args}
    return args


def _norm(message: Message) -> tuple:
    """What must be equal for a client's message to be the one the episode holds."""
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"]), sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message.get("role"), text_of(message.get("content")), calls


def state_hash(value) -> int:
    """A 63-bit hash of JSON-able `value` (token ids, messages), the same in every process and on every rank."""
    text = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big") >> 1
