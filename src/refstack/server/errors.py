"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}``.

Handlers raise ``APIError``; one exception handler turns it into the body, so every
bad request gets the same shape whatever part of the server noticed it.  Types are
snake_case like OpenAI's (``invalid_request_error``, ``not_found_error``,
``server_overloaded``, ``server_error``); codes are strings.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError


class APIError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(name: str) -> APIError:
    """vLLM's 404 for a model it does not serve (its message; this module's body shape)."""
    return APIError(404, f"The model `{name}` does not exist.", type="not_found_error", param="model",
                    code="model_not_found")


def request_too_large(limit: int) -> APIError:
    """413 for a body over ``--max-request-bytes``; the connection closes after it, since
    the rest of the body is never read."""
    return APIError(413, f"request body is larger than this server's limit of {limit} bytes "
                    "(--max-request-bytes)", code="request_too_large", headers={"Connection": "close"})


def from_validation_error(err: ValidationError) -> APIError:
    """The first problem pydantic found, named by its field path (``messages.0.content``)."""
    first = err.errors()[0]
    param = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p)) or None
    where = f"'{param}': " if param else ""
    return bad_request(f"{where}{first['msg']}", param=param, code="invalid_value")


def _is_union_tag(part: object) -> bool:
    """pydantic names the member of a union that failed (``prompt.str``); users want ``prompt``."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part)


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


async def api_error_handler(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
