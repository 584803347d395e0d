"""The policy endpoint: an OpenAI-compatible HTTP server on a loopback port, backed by the stage's sampler.

Each episode has a base URL of its own, `http://127.0.0.1:PORT/episodes/ID/v1`, so any program written against
the `openai` SDK drives it by its `base_url` alone. Routes, as vLLM's server has them:

- `POST .../v1/chat/completions`: `messages` (and `tools`), rendered by the policy's chat template;
- `POST .../v1/completions`: `prompt` as text or as token ids;
- `GET /v1/models` (also under an episode's URL): the one served model.

`logprobs: true` returns each sampled token's log-prob; `return_token_ids: true` (vLLM's extension, through the
SDK's `extra_body`) returns `prompt_token_ids` and each choice's `token_ids`; `stream: true` sends the answer as
server-sent events once it is whole. Sampling follows the stage's `generation` settings (temperature, top-p),
not the request's: the trainer scores the distribution the stage samples from; `max_tokens` can only lower the
stage's `max_new_tokens`. A malformed request gets the OpenAI error shape and its HTTP status.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from typing import Any, Awaitable, Callable

ROLES = {"system", "developer", "user", "assistant", "tool"}
MODEL = "policy"  # the served model's name; a request may name any model


class RequestError(Exception):
    """A request the endpoint answers with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.param, self.code, self.kind = status, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def chat_request(body: Any) -> dict:
    """A chat completions request, checked: messages, tools, max_tokens and the flags the endpoint serves."""
    body = _common(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "`messages` must be a non-empty list of messages", "messages")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise RequestError(400, f"messages[{i}] must be an object whose `role` is one of {sorted(ROLES)}",
                               f"messages[{i}].role")
        if not isinstance(m.get("content"), (str, list, type(None))):
            raise RequestError(400, f"messages[{i}].content must be a string, a list of parts or null",
                               f"messages[{i}].content")
    tools = body.get("tools")
    if tools is not None and (not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function", {}).get("name"), str) for t in tools)):
        raise RequestError(400, "`tools` must be a list of {type: function, function: {name, ...}}", "tools")
    body["tools"] = tools or None
    return body


def completion_request(body: Any) -> dict:
    """A completions request, checked: `prompt` is one string or one list of token ids."""
    body = _common(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = body["prompt"] = prompt[0]  # a batch of one
    if not (isinstance(prompt, str) or (isinstance(prompt, list) and prompt
                                        and all(isinstance(t, int) and t >= 0 for t in prompt))):
        raise RequestError(400, "`prompt` must be one string or one list of token ids", "prompt")
    return body


def _common(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    if body.get("n", 1) != 1:
        raise RequestError(400, "only n = 1 is served: an episode goes on from one completion", "n")
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise RequestError(400, f"`{name}` must be a positive integer", name)
    if body.get("stop"):
        raise RequestError(400, "stop sequences are not served: the policy stops at its end-of-turn token", "stop")
    if body.get("top_logprobs"):
        raise RequestError(400, "top_logprobs are not served: each sampled token's log-prob is", "top_logprobs")
    return body


def chat_response(request: dict, answer: "Answer") -> dict:
    """The OpenAI chat.completion object for one sampled turn."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = answer.tool_calls
    choice: dict[str, Any] = {"index": 0, "message": message, "finish_reason": answer.finish_reason,
                              "logprobs": None}
    if request.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                                          for t, lp in zip(answer.tokens, answer.logprobs)]}
    return _wrap("chat.completion", "chatcmpl", request, answer, choice)


def completion_response(request: dict, answer: "Answer") -> dict:
    """The OpenAI text_completion object for one sampled turn."""
    choice: dict[str, Any] = {"index": 0, "text": answer.text, "finish_reason": answer.finish_reason,
                              "logprobs": None}
    if request.get("logprobs") is not None and request.get("logprobs") is not False:
        offsets, at = [], 0
        for t in answer.tokens:
            offsets.append(at)
            at += len(t)
        choice["logprobs"] = {"tokens": list(answer.tokens), "token_logprobs": answer.logprobs,
                              "text_offset": offsets, "top_logprobs": None}
    return _wrap("text_completion", "cmpl", request, answer, choice)


def _wrap(kind: str, prefix: str, request: dict, answer: "Answer", choice: dict) -> dict:
    out = {"id": f"{prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
           "model": request.get("model") or MODEL, "choices": [choice],
           "usage": {"prompt_tokens": len(answer.prompt_ids), "completion_tokens": len(answer.ids),
                     "total_tokens": len(answer.prompt_ids) + len(answer.ids)}}
    if request.get("return_token_ids"):
        out["prompt_token_ids"] = answer.prompt_ids
        choice["token_ids"] = answer.ids
    return out


class Answer:
    """One sampled turn as the endpoint returns it."""

    def __init__(self, prompt_ids, ids, logprobs, tokens, text, content, tool_calls, finish_reason):
        self.prompt_ids, self.ids, self.logprobs, self.tokens = prompt_ids, ids, logprobs, tokens
        self.text, self.content, self.tool_calls, self.finish_reason = text, content, tool_calls, finish_reason


Handler = Callable[[str, dict], Awaitable[Answer]]


def app(chat: Handler, complete: Handler):
    """The Starlette application: routes, request checks and error shapes; `chat`/`complete` sample a turn."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0,
                                                          "owned_by": "alignflow"}]})

    def route(check, answer, respond):
        async def handle(request):
            try:
                try:
                    body = check(json.loads(await request.body()))
                except json.JSONDecodeError as exc:
                    raise RequestError(400, f"the request body is not JSON: {exc.msg}") from None
                out = respond(body, await answer(request.path_params["episode"], body))
            except RequestError as exc:
                return JSONResponse(exc.body(), status_code=exc.status)
            if body.get("stream"):
                return StreamingResponse(_events(out), media_type="text/event-stream")
            return JSONResponse(out)
        return handle

    async def outside(request):
        return JSONResponse(RequestError(404, "sampling runs under an episode's URL: /episodes/ID/v1/...",
                                         code="not_found").body(), status_code=404)

    return Starlette(routes=[
        Route("/v1/models", models), Route("/episodes/{episode}/v1/models", models),
        Route("/episodes/{episode}/v1/chat/completions", route(chat_request, chat, chat_response), methods=["POST"]),
        Route("/episodes/{episode}/v1/completions", route(completion_request, complete, completion_response),
              methods=["POST"]),
        Route("/v1/chat/completions", outside, methods=["POST"]), Route("/v1/completions", outside, methods=["POST"]),
    ])


async def _events(out: dict):
    """The whole answer as one chunk of server-sent events, then [DONE] (what streaming clients read)."""
    chunk = {**out, "object": out["object"] + ".chunk" if out["object"] == "chat.completion" else out["object"]}
    if "message" in out["choices"][0]:
        choice = dict(out["choices"][0])
        choice["delta"] = choice.pop("message")
        chunk["choices"] = [choice]
    yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"


class Server:
    """Uvicorn serving `application` on 127.0.0.1 (a free port), on the event loop it is started from."""

    def __init__(self, application):
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(application, log_level="warning", lifespan="off",
                                                    timeout_graceful_shutdown=1))
        self.server.install_signal_handlers = lambda: None  # the stage's own handlers stay in charge
        self.task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        self.task = asyncio.create_task(self.server.serve(sockets=[self.sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()  # the error it failed with
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
        self.sock.close()


def in_thread(main: Callable[[], Awaitable[Any]]) -> tuple[threading.Thread, dict]:
    """Run coroutine `main` on an event loop in a daemon thread; its result or error lands in the dict."""
    out: dict = {}

    def run():
        try:
            out["result"] = asyncio.run(main())
        except BaseException as exc:  # handed to the caller
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True, name="alignflow-endpoint")
    thread.start()
    return thread, out
