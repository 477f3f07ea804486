"""Streaming over a reused (keep-alive) connection is not held back by Nagle's algorithm.

With Nagle on, the server's small SSE writes waited for the client's delayed ACK of the
previous response's last segment: on every reused connection the whole stream arrived
in one burst about 40 ms late, and every TTFT/ITL measured on it was wrong.

The streaming check counts the TCP segments that carried each response (Linux's
``tcpi_segs_in``), which the client's own scheduling cannot change; its recv() count
did, on a busy machine (about 1 run in 9 failed with reads [2, 2, 3]).
"""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time

import pytest

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


# struct tcp_info (linux/tcp.h): tcpi_segs_in, the segments this socket has received,
# is the u32 at byte 140 (after the u64 bytes_acked/bytes_received and u32 segs_out).
_TCPI_SEGS_IN = 140


def _segments_in(conn: socket.socket) -> int:
    info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    assert len(info) >= _TCPI_SEGS_IN + 4, "kernel too old for tcpi_segs_in"
    return struct.unpack_from("I", info, _TCPI_SEGS_IN)[0]


@pytest.mark.skipif(not hasattr(socket, "TCP_INFO"), reason="needs Linux's TCP_INFO")
def test_stream_on_a_reused_connection_arrives_token_by_token(refstack_server) -> None:  # type: ignore[no-untyped-def]
    host, port = refstack_server.url.removeprefix("http://").rsplit(":", 1)
    segments, reads = [], []
    with socket.create_connection((host, int(port)), timeout=60) as conn:
        _stream_reads(conn, _request(4))  # the first response leaves its last segment to be ACKed
        for _ in range(3):
            before = _segments_in(conn)
            reads.append(len(_stream_reads(conn, _request(8))))
            segments.append(_segments_in(conn) - before)
    # Every recv() takes at least one segment (a check that tcp_info was read right).
    assert all(s >= r for s, r in zip(segments, reads)), (segments, reads)
    # 8 tokens come from 8 engine steps, milliseconds apart, each event written on its
    # own.  Held back by Nagle, everything after the headers left in one segment (2 per
    # response); streamed, the events leave in several.  Counted as the segments that
    # reached the client's socket, not its recv() calls: a client descheduled on a busy
    # machine reads segments that arrived apart in one call ([2, 2, 3] reads of 12
    # segments), which says nothing about the server.  Two of three, as before.
    assert sorted(segments)[1] >= 4, (segments, reads)
