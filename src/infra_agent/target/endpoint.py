"""``EndpointTarget``: an already-running OpenAI-compatible server.

It offers the same surface as ``ServerProcess`` (``url``, ``metrics_url``,
``check_alive()`` ...) so a benchmark does not care which kind it talks to.
Nothing is started or stopped; entering the context checks that the URL answers.
"""

from __future__ import annotations

from pathlib import Path
from types import TracebackType
from urllib.parse import urlsplit

import httpx

from infra_agent.errors import TargetError
from infra_agent.target.auth import request_headers
from infra_agent.workspace.models import EndpointTargetSpec


class EndpointTarget:
    def __init__(self, spec: EndpointTargetSpec, *, timeout_s: float = 5.0, file: str | None = None) -> None:
        self.spec = spec
        self.timeout_s = timeout_s
        self._file = file

    @property
    def url(self) -> str:
        # The base URL: requests go to {url}/v1/...  An OpenAI-style ".../v1" (as client
        # libraries take it) would make that /v1/v1/..., a 404, so it is dropped here.
        url = self.spec.url.rstrip("/")
        return url[:-3].rstrip("/") if url.lower().endswith("/v1") else url

    @property
    def metrics_url(self) -> str | None:
        return self._absolute(self.spec.metrics_url)

    @property
    def model(self) -> str | None:
        return self.spec.model

    @property
    def request_headers(self) -> dict[str, str]:
        """Headers every request carries (``headers`` and the bearer key from ``api_key_env``)."""
        return request_headers(self.spec.api_key_env, self.spec.headers, file=self._file)

    @property
    def log_path(self) -> Path | None:
        return None  # not ours: its logs live wherever it was started

    @property
    def pid(self) -> int | None:
        return None

    def log_tail(self, n: int = 40) -> str:
        return ""

    def check_alive(self) -> None:
        """Raise ``TargetError`` if the endpoint does not answer (or not 200 on ready_url)."""
        # Any HTTP answer from /v1/models proves something listens; ready_url, when
        # given, must say 200.
        probe = self._absolute(self.spec.ready_url) or f"{self.url}/v1/models"
        # A proxy from the environment must not intercept a loopback endpoint.
        loopback = urlsplit(probe).hostname in ("127.0.0.1", "localhost", "::1")
        # The key goes only to the endpoint's own origin.
        headers = self.request_headers if urlsplit(probe).netloc == urlsplit(self.url).netloc else {}
        try:
            resp = httpx.get(probe, timeout=self.timeout_s, trust_env=not loopback, headers=headers)
        except httpx.HTTPError as exc:
            raise TargetError(f"endpoint {self.url} is unreachable: GET {probe} failed ({type(exc).__name__}: {exc})") from None
        if self.spec.ready_url is not None and resp.status_code != 200:
            raise TargetError(f"endpoint {self.url} is not ready: GET {probe} answered HTTP {resp.status_code}, expected 200")

    def __enter__(self) -> EndpointTarget:
        self.check_alive()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        return None

    def _absolute(self, path_or_url: str | None) -> str | None:
        if path_or_url is None:
            return None
        if path_or_url.startswith("/"):
            return self.url + path_or_url
        return path_or_url
