"""The timeline probe's torch.profiler window: ``POST /start_profile`` before the traced
window and ``POST /stop_profile`` after it, the endpoints refstack, vLLM and SGLang serve.

The Kineto trace this leaves (refstack answers its path) joins the window's span trace on
one clock, so a GPU target's streams appear beside its threads (``infra_agent.trace.gpu``:
busy share within the engine's steps, ``launch_bound``).  A target without the endpoints,
or whose profiler fails, costs the analysis nothing but the Kineto part: the probe says
why in the timeline's warnings.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any


def request_json(url: str, method: str = "GET", params: dict[str, str] | None = None,
                 timeout_s: float = 60.0) -> tuple[Any, str | None]:
    """The JSON answer of ``url``, or None and why not (one line).  A POST's empty body is
    ``{}`` (vLLM answers its profiler endpoints with none); a GET's is an error."""
    full = url + ("?" + urllib.parse.urlencode(params) if params else "")
    data = b"" if method == "POST" else None
    try:
        with urllib.request.urlopen(urllib.request.Request(full, data=data, method=method), timeout=timeout_s) as resp:
            body = resp.read()
            return json.loads((body or b"{}") if method == "POST" else body), None
    except urllib.error.HTTPError as exc:
        return None, f"HTTP {exc.code}: {exc.read()[:300].decode('utf-8', 'replace')}"
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def start(base_url: str, output_dir: Path, timeout_s: float = 120.0) -> str | None:
    """Start the target's profiler, writing into ``output_dir``; None, or why it did not start."""
    _, err = request_json(base_url.rstrip("/") + "/start_profile", "POST", {"output_dir": str(output_dir)}, timeout_s)
    return None if err is None else f"torch.profiler not started on the target (POST /start_profile: {err})"


def stop(base_url: str, timeout_s: float = 300.0) -> tuple[Path | None, str | None]:
    """Stop it: the Kineto trace's path, or None and why there is none."""
    doc, err = request_json(base_url.rstrip("/") + "/stop_profile", "POST", timeout_s=timeout_s)
    if err is not None:
        return None, f"torch.profiler trace not written (POST /stop_profile: {err})"
    trace = doc.get("trace") if isinstance(doc, dict) else None
    if not trace or not Path(trace).is_file():
        return None, f"POST /stop_profile named no readable trace file ({trace!r}): a target on another host?"
    return Path(trace), None
