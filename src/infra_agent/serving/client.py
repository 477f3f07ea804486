"""Streaming OpenAI client: one request in, one ``RequestRecord`` out.

Timing follows vLLM ``bench serve`` by default (``timing.py``): every streamed chunk
that carries ``choices`` is a token event, empty text or not; TTFT is send -> the first
one, each later one adds an inter-token gap, and the latency ends at the last one.  The
content-based definition (only chunks with text count) is kept beside it in the same
record.  Output tokens come from the server's ``usage`` when it reports them (we ask
with ``stream_options.include_usage``, as vLLM does), else from the number of token
chunks.

A request never raises: transport and protocol problems are written into the record
(``error``/``error_kind``) so one bad request cannot kill a window, and the runner
decides what a pattern of failures means (unreachable server, wrong protocol).
"""

from __future__ import annotations

import asyncio
import errno
import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from infra_agent.serving.timing import StreamClock

Endpoint = Literal["completions", "chat"]
# "empty": a well-formed stream that carried no token chunk at all (nothing to time a TTFT by).
# "client": this machine could not open the connection (out of file descriptors or local
# ports): the server was never asked, so it says nothing about the server.
ErrorKind = Literal["", "connect", "client", "timeout", "http", "protocol", "empty", "other"]

# connect() errors that are this machine's limits, not the server's answer.
_CLIENT_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM, errno.EADDRNOTAVAIL})

_PATHS: dict[str, str] = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(slots=True)
class RequestInput:
    """What to send: a prompt string (completions) or a message list (chat)."""

    prompt: str | list[dict[str, str]]
    prompt_len: int
    output_len: int
    num_images: int = 0  # image parts in the prompt (serving/mm_dataset.py)


@dataclass(slots=True)
class RequestRecord:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    # vLLM's definition (the default): token chunks, empty text included.
    ttft: float = 0.0  # seconds, send -> first chunk with choices
    itl: list[float] = field(default_factory=list)  # seconds, one per gap between such chunks
    latency: float = 0.0  # seconds, send -> last chunk with choices
    start: float = 0.0  # perf_counter() at send
    error: str = ""
    error_kind: ErrorKind = ""
    # The content-based definition: only chunks with non-empty text count, and the
    # latency runs to the end of the stream.  None when the answer had no text at all.
    content_ttft: float | None = None
    content_itl: list[float] = field(default_factory=list)
    content_latency: float | None = None
    usage_prompt_tokens: int | None = None  # the server's count of the prompt, when it said
    num_images: int = 0  # the request's image parts (multimodal datasets)
    # What was asked: ``max_tokens``, and whether ``ignore_eos`` was sent with it (then the
    # answer's length is the request's, not the model's: see ``answer_lengths``).
    max_tokens: int = 0
    ignore_eos: bool = False
    output_from_usage: bool = False  # output_len is the server's usage count, not chunks counted
    chunks: int = 0  # chunks with choices
    content_chunks: int = 0  # of them, those with text


@dataclass(frozen=True, slots=True)
class RequestOptions:
    endpoint: Endpoint = "completions"
    model: str = "default"
    temperature: float | None = 0.0  # None: none sent, the server's default applies (vLLM's client)
    ignore_eos: bool = True
    # Extra request headers (auth among them), as pairs so the options stay hashable.
    headers: tuple[tuple[str, str], ...] = ()


def endpoint_path(endpoint: str) -> str:
    assert endpoint in _PATHS, f"unknown endpoint {endpoint!r}"
    return _PATHS[endpoint]


# The longest SSE line we accept.  aiohttp's line reader refuses longer ones; a usage
# chunk or a chat delta is far below this, so hitting it means a broken stream.
_MAX_LINE_BYTES = 1 << 22


def make_http_client(max_connections: int, timeout_s: float = 600.0) -> aiohttp.ClientSession:
    """The load generator's HTTP session: aiohttp, because it is cheap per streamed chunk.

    Measured on a 2-core box against the same server (CPU seconds of the client process
    per streamed token, large minus small run): httpx 231 us, aiohttp 125 us.  About half
    of httpx's cost was its per-chunk receive path, and a client that burns the cores it
    shares with the server distorts what it measures.

    trust_env=False: a proxy from the environment must never sit between the load
    generator and a loopback server; it would distort every latency.  ``sock_read`` is
    the longest silence allowed between two chunks, not a cap on the whole stream.
    """
    connector = aiohttp.TCPConnector(limit=max_connections, limit_per_host=max_connections)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10.0, connect=None, sock_read=timeout_s)
    return aiohttp.ClientSession(
        connector=connector, timeout=timeout, trust_env=False, read_bufsize=_MAX_LINE_BYTES, auto_decompress=False
    )


async def preopen_connections(client: aiohttp.ClientSession, base_url: str, n: int,
                              headers: dict[str, str] | None = None) -> int:
    """Open ``n`` connections before the window, as ``n`` concurrent ``GET /v1/models``; returns
    how many answered.

    The pool opens a connection when a request finds none idle, so without this the first
    wave of a window at concurrency ``n`` pays ``n`` minus the warm-up's connects inside its
    TTFT (62-74 ms against vLLM's client's 40-43 ms for the first requests on one vLLM
    server); vLLM's and aiperf's clients open theirs up front.  A server without
    ``/v1/models`` still got its connections opened: the status does not matter."""

    async def one() -> bool:
        async with client.get(base_url.rstrip("/") + "/v1/models", headers=headers) as resp:
            await resp.read()
            return True

    done = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
    return sum(1 for d in done if d is True)


def build_payload(req: RequestInput, opts: RequestOptions) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": opts.model,
        "max_tokens": req.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.temperature is not None:
        payload["temperature"] = opts.temperature
    if opts.ignore_eos:
        payload["ignore_eos"] = True  # vLLM extension; servers that do not know it ignore it
    if opts.endpoint == "chat":
        payload["messages"] = req.prompt if isinstance(req.prompt, list) else [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt if isinstance(req.prompt, str) else "\n".join(m["content"] for m in req.prompt)
    return payload


def _chunk_content(data: dict[str, Any], chat: bool) -> str:
    choices = data.get("choices")
    if not choices:
        return ""
    choice = choices[0]
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # Reasoning tokens are generated tokens too; vLLM counts them toward TTFT/ITL.
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _role_announcement(data: dict[str, Any], chat: bool) -> bool:
    """A chat chunk that only announces the assistant's role: not a token.

    vLLM's client counts it, which is harmless against vLLM's server: that sends it
    together with the first token (at the first engine output), so the two arrive
    about 0.1 ms apart.  refstack sends it before the request is even scheduled, so
    counting it there would make TTFT the HTTP round trip and hide all queueing.
    """
    if not chat:
        return False
    delta = (data["choices"][0] or {}).get("delta") or {}
    return "role" in delta


async def send_request(client: aiohttp.ClientSession, base_url: str, req: RequestInput, opts: RequestOptions) -> RequestRecord:
    """Send one streaming request and time it.  Never raises for request-level trouble."""
    rec = RequestRecord(prompt_len=req.prompt_len, max_tokens=req.output_len, ignore_eos=opts.ignore_eos,
                        num_images=req.num_images)
    url = base_url.rstrip("/") + endpoint_path(opts.endpoint)
    payload = build_payload(req, opts)
    headers = dict(opts.headers) if opts.headers else None
    rec.start = st = time.perf_counter()
    clock = StreamClock(st)
    try:
        async with client.post(url, json=payload, headers=headers) as resp:
            if await _refused(resp, url, rec):
                return rec
            read = await _read_stream(resp, url, opts.endpoint == "chat", rec, clock)
            if read is None:
                return rec
            end = time.perf_counter()
    except aiohttp.ClientConnectorError as exc:
        if getattr(exc.os_error, "errno", None) in _CLIENT_LIMITS:
            rec.error, rec.error_kind = (f"this client could not open a connection to {url}: {exc} (a limit of this "
                                         "machine's, not the server's: raise the open-file limit, ulimit -n, or lower "
                                         "the concurrency)"), "client"
            return rec
        rec.error, rec.error_kind = f"cannot connect to {url}: {exc}", "connect"
        return rec
    except asyncio.TimeoutError as exc:  # aiohttp's socket timeouts subclass it
        rec.error, rec.error_kind = f"timed out talking to {url}: {type(exc).__name__}", "timeout"
        return rec
    except (aiohttp.ClientError, OSError, ValueError) as exc:
        # A server that dies mid-stream lands here (ServerDisconnectedError /
        # ClientPayloadError); ValueError is aiohttp's answer to an over-long line.
        rec.error, rec.error_kind = f"{type(exc).__name__} from {url}: {exc}", "other"
        return rec
    saw_data, usage_tokens = read
    if not saw_data:
        rec.error, rec.error_kind = f"{url} sent an event stream without any OpenAI 'data:' chunks", "protocol"
        return rec
    return _timed(rec, clock, end, usage_tokens)


async def _refused(resp: aiohttp.ClientResponse, url: str, rec: RequestRecord) -> bool:
    """Whether the answer is no event stream at all (an HTTP error, another content type); ``rec`` says which."""
    if resp.status != 200:
        body = (await resp.content.read(300)).decode(errors="replace")
        rec.error, rec.error_kind = f"HTTP {resp.status} from {url}: {body}", "http"
        return True
    ctype = resp.headers.get("content-type", "")
    if "text/event-stream" not in ctype:
        body = (await resp.content.read(200)).decode(errors="replace")
        rec.error_kind = "protocol"
        rec.error = (
            f"{url} answered with content-type {ctype or '<none>'!r}, not a server-sent event stream; "
            f"expected an OpenAI-compatible server that honours stream=true (body starts: {body!r})"
        )
        return True
    return False


async def _read_stream(resp: aiohttp.ClientResponse, url: str, chat: bool, rec: RequestRecord,
                       clock: StreamClock) -> tuple[bool, int | None] | None:
    """Feed every chunk of the stream to ``clock``: (whether any data line came, the usage's
    completion tokens), or None when the stream broke the protocol (``rec`` says how)."""
    usage_tokens: int | None = None
    saw_data = False
    perf = time.perf_counter
    async for line in resp.content:
        # Cheap SSE parsing: only "data:" lines matter; comments, event names
        # and blank separators are skipped without decoding.
        if not line.startswith(b"data:"):
            continue
        body_b = line[5:].strip()
        if body_b == b"[DONE]":
            break
        now = perf()
        try:
            data = json.loads(body_b)
        except (json.JSONDecodeError, UnicodeDecodeError):
            rec.error = f"{url} streamed a non-JSON data line: {body_b[:120].decode(errors='replace')!r}"
            rec.error_kind = "protocol"
            return None
        saw_data = True
        if "error" in data and not data.get("choices"):
            rec.error, rec.error_kind = f"server error in stream: {str(data['error'])[:200]}", "http"
            return None
        usage = data.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens"):
                rec.prompt_len = rec.usage_prompt_tokens = int(usage["prompt_tokens"])
        # A chunk with choices is a token even when its text is empty (a
        # special token, half a UTF-8 character): vLLM's client counts it.
        has_text = bool(_chunk_content(data, chat))
        clock.chunk(now, bool(data.get("choices")) and (has_text or not _role_announcement(data, chat)), has_text)
    return saw_data, usage_tokens


def _timed(rec: RequestRecord, clock: StreamClock, end: float, usage_tokens: int | None) -> RequestRecord:
    """``rec`` with the stream's timings under both definitions, or its error when no token came."""
    st = rec.start
    tokens, text = clock.chunks, clock.content
    rec.chunks, rec.content_chunks = tokens.events, text.events
    if tokens.first is None or tokens.last is None:
        rec.error = "stream ended without a single token chunk (no data line with choices)"
        if usage_tokens:
            rec.error += f", though its usage reported {usage_tokens} completion tokens"
        rec.error_kind = "empty"
        return rec
    rec.ttft, rec.itl, rec.latency = tokens.first - st, tokens.gaps, tokens.last - st
    if text.first is not None:
        rec.content_ttft, rec.content_itl, rec.content_latency = text.first - st, text.gaps, end - st
    rec.output_len = usage_tokens if usage_tokens is not None else tokens.events
    rec.output_from_usage = usage_tokens is not None
    rec.success = True
    return rec
