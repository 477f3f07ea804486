"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions.

Streaming answers are server-sent events ending in ``data: [DONE]``.  A client that
goes away aborts its request: the engine frees its slot at the next step.  A ``model``
other than the served one is a 404; logprobs ride with the text of each chunk.

Completions with ``echo`` (not streamed) return the prompt's text before the
completion, and with ``logprobs`` the prompt tokens' teacher-forced logprobs before
the generated ones (the first prompt token's are null), as vLLM does; ``max_tokens:
0`` returns the prompt's alone (``finish_reason`` "length", no completion tokens).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from infra_agent import tracing
from refstack.engine import Engine, QueueFullError, RequestOutput, SamplingParams
from refstack.engine.consumers import RequestStream
from refstack.model.tokenizer import UnencodableTextError
from refstack.server.chat_images import chat_with_images
from refstack.server.errors import APIError, bad_request, model_not_found
from refstack.server.logprobs import (
    ChatLogprobs,
    CompletionLogprobs,
    Entry,
    LogprobCursor,
    LogprobParams,
)
from refstack.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    parse_body,
    sampling_params,
)

# How often a request with nothing to send checks whether its client is still there.
DISCONNECT_POLL_S = 0.25
# Completions default to 16 tokens like OpenAI's legacy endpoint; chat fills the context.
COMPLETION_DEFAULT_MAX_TOKENS = 16
RETRY_AFTER_S = 1

# A response chunk of the endpoint's shape: (text, finish_reason, usage, logprobs entries or None).
Chunk = Callable[[str, str | None, dict[str, int] | None, list[Entry] | None], dict[str, Any]]


def register_openai_routes(app: FastAPI, engine: Engine, model_name: str) -> None:
    tok = engine.tokenizer
    vocab = engine.model.config.vocab_size

    def check_model(body: CompletionRequest | ChatCompletionRequest) -> None:
        if body.model is not None and body.model != model_name:
            raise model_not_found(body.model)

    def encode(text: str, param: str, **kw: Any) -> list[int]:
        try:
            return tok.encode(text, **kw)
        except UnencodableTextError as exc:  # parse_body refuses these first; this is the backstop
            raise bad_request(f"'{param}': {exc}", param=param, code="invalid_value") from None

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": model_name, "object": "model", "created": 0, "owned_by": "refstack",
            "max_model_len": engine.max_seq_len}]})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Any:
        body = parse_body(await request.body(), CompletionRequest)
        check_model(body)
        body.check_echo(bool(getattr(engine, "prompt_logprobs_supported", False)))
        if isinstance(body.prompt, str):
            prompt_ids = encode(body.prompt, "prompt", add_bos=True)
        else:
            if any(not 0 <= t < vocab for t in body.prompt):
                raise bad_request(f"token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
            prompt_ids = list(body.prompt)
        params = sampling_params(body, len(prompt_ids), engine.max_seq_len, COMPLETION_DEFAULT_MAX_TOKENS, "prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        logprobs = CompletionLogprobs(tok)
        echo_text = "" if not body.echo else body.prompt if isinstance(body.prompt, str) else tok.decode(prompt_ids)

        def chunk(text: str, finish: str | None, usage: dict[str, int] | None,
                  entries: list[Entry] | None) -> dict[str, Any]:
            if body.echo:  # never streamed (check_echo), so this is the one whole answer
                text, finish, usage, rendered = _echoed(body, echo_text, prompt_ids, params, logprobs, text, finish,
                                                        usage, entries)
            else:
                rendered = None if entries is None else logprobs.render(entries)
            out: dict[str, Any] = {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                                   "choices": [{"index": 0, "text": text, "logprobs": rendered,
                                                "finish_reason": finish}]}
            if usage is not None:
                out["usage"] = usage
            return out

        return await _respond(engine, request, body.stream, _include_usage(body), prompt_ids, params, chunk, None)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Any:
        body = parse_body(await request.body(), ChatCompletionRequest)
        check_model(body)
        mm = None
        if any(m.has_parts for m in body.messages):  # content parts: text and images (chat_images)
            prompt_ids, mm = await chat_with_images(engine, body.messages)
        else:
            try:
                prompt_ids = tok.apply_chat_template([m.model_dump() for m in body.messages])
            except UnencodableTextError as exc:
                raise bad_request(f"'messages': {exc}", param="messages", code="invalid_value") from None
        params = sampling_params(body, len(prompt_ids), engine.max_seq_len, None, "messages")
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        logprobs = ChatLogprobs(tok)

        def chunk(text: str, finish: str | None, usage: dict[str, int] | None,
                  entries: list[Entry] | None) -> dict[str, Any]:
            rendered = None if entries is None else logprobs.render(entries)
            if body.stream:
                choice: dict[str, Any] = {"index": 0, "delta": {} if finish else {"content": text},
                                          "logprobs": rendered, "finish_reason": finish}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "message": {"role": "assistant", "content": text},
                          "logprobs": rendered, "finish_reason": finish}
                obj = "chat.completion"
            out: dict[str, Any] = {"id": cid, "object": obj, "created": created, "model": model_name,
                                   "choices": [choice]}
            if usage is not None:
                out["usage"] = usage
            return out

        role_chunk = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                      "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                   "logprobs": None, "finish_reason": None}]}
        return await _respond(engine, request, body.stream, _include_usage(body), prompt_ids, params, chunk,
                              role_chunk, mm)


def _echoed(body: CompletionRequest, echo_text: str, prompt_ids: list[int], params: SamplingParams,
            logprobs: CompletionLogprobs, text: str, finish: str | None, usage: dict[str, int] | None,
            entries: list[Entry] | None) -> tuple[str, str | None, dict[str, int] | None, dict[str, Any] | None]:
    """A completion's answer with its prompt echoed before it (text, finish reason, usage, logprobs)."""
    if body.prompt_only:  # max_tokens 0: the one token the engine sampled after the prompt is left out
        text, finish, entries = "", "length", (None if entries is None else [])
        if usage is not None:
            usage = {**usage, "completion_tokens": 0, "total_tokens": usage["prompt_tokens"]}
    rendered = None
    if entries is not None:
        prompt_entries = params.prompt_entries if isinstance(params, LogprobParams) else []
        head = logprobs.render_prompt(prompt_ids, prompt_entries, len(echo_text))
        tail = logprobs.render(entries)
        rendered = {k: head[k] + tail[k] for k in head}
    return echo_text + text, finish, usage, rendered


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _usage(out: RequestOutput) -> dict[str, int]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens}


async def _respond(engine: Engine, request: Request, stream: bool, include_usage: bool, prompt_ids: list[int],
                   params: SamplingParams, chunk: Chunk, first: dict[str, Any] | None, mm: Any = None) -> Any:
    try:
        rs = engine.submit(prompt_ids, params, mm=mm) if mm is not None else engine.submit(prompt_ids, params)
    except QueueFullError as exc:
        raise APIError(503, f"server busy: {exc}; retry later", type="server_overloaded", code="queue_full",
                       headers={"Retry-After": str(RETRY_AFTER_S)}) from None
    tracing.instant("http.submit", cat="server", request_id=rs.request_id, path=request.url.path)
    cursor = LogprobCursor(params)
    if stream:
        return StreamingResponse(_sse(rs, request, include_usage, chunk, first, cursor, engine),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rs.request_id})
    text: list[str] = []
    last: RequestOutput | None = None
    async for out in _deltas(rs, request):
        text.append(out.text)
        last = out
    if last is None or not last.finished:
        return JSONResponse({}, status_code=499)  # the client is gone; nobody reads this
    if last.finish_reason == "error":
        raise APIError(500, _failed(engine), type="server_error")
    entries = cursor.take(last.completion_tokens) if cursor.enabled else None
    return JSONResponse(chunk("".join(text), last.finish_reason, _usage(last), entries))


def _failed(engine: Any) -> str:
    """The 500's message: what failed, when the engine knows (a tensor-parallel rank that died)."""
    reason = getattr(getattr(engine, "model", None), "failure", None)
    return "the engine failed while running this request" + (f": {reason}" if isinstance(reason, str) else "")


async def _sse(rs: RequestStream, request: Request, include_usage: bool, chunk: Chunk,
               first: dict[str, Any] | None, cursor: LogprobCursor, engine: Any = None) -> AsyncIterator[str]:
    try:
        if first is not None:
            yield _event(first)
        written = False
        async for out in _deltas(rs, request):
            if out.finished and out.finish_reason == "error":
                yield _event(APIError(500, _failed(engine), type="server_error").body())
                break
            # A delta's logprobs ride with its text: one entry per token id it carries.
            entries = cursor.take(len(out.token_ids)) if cursor.enabled else None
            if out.finished:
                if out.text or out.token_ids:
                    yield _event(chunk(out.text, None, None, entries))
                # As OpenAI's API: usage travels only in its own last chunk, and only
                # when the client asked for it with stream_options.include_usage.
                final = chunk("", out.finish_reason, None, None)
                yield _event(final)
                if include_usage:
                    yield _event({**final, "choices": [], "usage": _usage(out)})
            elif out.text or out.token_ids:
                # One event per step even when the text is empty (a byte still inside a
                # UTF-8 character, text held back for a stop string), so a client that
                # times every event sees every step.  Clients that follow vLLM's
                # benchmark convention time content-bearing events only.
                yield _event(chunk(out.text, None, None, entries))
            if not written and (out.text or out.token_ids):
                # Resumed after the server wrote the first token's event: engine.first_token -> here
                # is the first token's delivery (the TTFT split's last part).
                written = True
                tracing.instant("http.first_write", cat="server", request_id=rs.request_id)
        yield "data: [DONE]\n\n"
    finally:
        rs.abort()  # a write to a gone client closes this generator; free the slot now, not at GC


async def _deltas(rs: RequestStream, request: Request) -> AsyncIterator[RequestOutput]:
    """The request's deltas until it finishes or its client disconnects (then it is aborted)."""
    next_check = time.monotonic() + DISCONNECT_POLL_S
    try:
        while not rs.finished:
            try:
                out = await asyncio.wait_for(rs.get(), DISCONNECT_POLL_S)
            except asyncio.TimeoutError:
                out = None
            # Checked on a clock, not only when idle: a busy request of a client that gave
            # up would otherwise run to max_tokens (nothing is written until the end).
            if time.monotonic() >= next_check:
                if await request.is_disconnected():
                    return
                next_check = time.monotonic() + DISCONNECT_POLL_S
            if out is not None:
                yield out
    finally:
        rs.abort()
        tracing.instant("http.done", cat="server", request_id=rs.request_id)


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"
