"""Streaming over a reused (keep-alive) connection is not held back by Nagle's algorithm.

With Nagle on, the server's small SSE writes waited for the client's delayed ACK of the
previous response's last segment: on every reused connection the whole stream arrived
in one burst about 40 ms late, and every TTFT/ITL measured on it was wrong.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

from refstack.cli import _bind


def test_accepted_connections_have_nagle_off() -> None:
    # asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and accepted
    # sockets inherit the listener's proto: check the mechanism, not a timing.
    sock = _bind("127.0.0.1", 0)

    async def go() -> int:
        loop = asyncio.get_running_loop()
        seen: asyncio.Future[int] = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                raw = transport.get_extra_info("socket")
                seen.set_result(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await loop.create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()
            await server.wait_closed()

    assert asyncio.run(go()) != 0


def _request(max_tokens: int) -> bytes:
    body = json.dumps({"prompt": "keep alive", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}).encode()
    head = f"POST /v1/completions HTTP/1.1\r\nHost: refstack\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


def _stream_reads(conn: socket.socket, req: bytes) -> list[tuple[float, int]]:
    """Send one request on an open connection; (seconds since send, bytes) per recv()."""
    t0 = time.perf_counter()
    conn.sendall(req)
    got, reads = b"", []
    while not got.endswith(b"0\r\n\r\n"):  # the chunked body's terminator
        data = conn.recv(1 << 16)
        assert data, "the server closed the keep-alive connection"
        got += data
        reads.append((time.perf_counter() - t0, len(data)))
    assert b"data: [DONE]" in got
    return reads


def test_stream_on_a_reused_connection_arrives_token_by_token(refstack_server) -> None:  # type: ignore[no-untyped-def]
    host, port = refstack_server.url.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        _stream_reads(conn, _request(4))  # the first response leaves its last segment to be ACKed
        reads = [len(_stream_reads(conn, _request(8))) for _ in range(3)]
    # 8 tokens come from 8 engine steps, milliseconds apart.  Held back by Nagle,
    # everything after the headers came in one read (2 reads per response); streamed,
    # the chunks come in several.  Two of three, so one descheduled client cannot fail it.
    assert sorted(reads)[1] >= 4, reads
