"""A cap on request body size (``--max-request-bytes``), enforced before the body is read.

A pure ASGI middleware, so it sees the request before any route reads a byte:

- a ``Content-Length`` over the cap is answered 413 at once, from the headers alone
  (the body is never read, and with ``Expect: 100-continue`` never even sent);
- a body without one (``Transfer-Encoding: chunked``) is counted as it arrives, and the
  read that crosses the cap raises the 413 into the route that is reading it.

Either way the answer says ``Connection: close``: the rest of the body is never read, so
the connection cannot carry another request.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from refstack.server.errors import request_too_large

Scope = dict[str, Any]
Message = dict[str, Any]


class BodySizeLimit:
    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = _content_length(scope)
        if length is not None:
            if length > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            # The HTTP layer holds a body to its declared length: nothing to count.
            await self.app(scope, receive, send)
            return
        seen = 0

        async def counted() -> Message:
            nonlocal seen
            message: Message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise request_too_large(self.max_bytes)
            return message

        await self.app(scope, counted, send)

    async def _refuse(self, scope: Scope, receive: Any, send: Any) -> None:
        err = request_too_large(self.max_bytes)
        await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP layer rejects a malformed length before we get here
    return None
