"""Result files: write one run, read one or many runs back, and the failed-run record.

A file holds one vLLM-style result object, a list of them, or ``{"runs": [...]}``; a
failed run (``ok: false``) stays in the file beside the good ones so a crash late in a
series does not erase what was measured before it.

Beside a result ``r.json``, ``r.requests.jsonl`` holds one line per measured request,
appended as each finishes (like aiperf's ``profile_export.jsonl``), so a run that is
killed keeps what it measured.  Results also carry where they were measured: host,
CPU, GPUs, library versions, and the workspace's git commit (``environment_info``,
``git_info``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import json
import math
import os
import platform
import re
import shutil
import socket
import subprocess
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from infra_agent.errors import BenchmarkError

# Versions recorded in every result (those installed); read from package metadata,
# so nothing is imported for it.
_VERSIONED = ("infra-agent", "aiohttp", "numpy", "httpx", "pydantic", "prometheus-client", "torch", "transformers", "vllm")


def failed_result(error: str, log_tail: str = "", log_path: str | None = None) -> dict[str, Any]:
    """A run that produced no trustworthy numbers; kept in result files beside good runs."""
    return {"ok": False, "error": error, "log_tail": log_tail, "log_path": log_path,
            "date": datetime.now(timezone.utc).isoformat(timespec="seconds")}


def write_result(result: dict[str, Any] | list[dict[str, Any]], path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    # Write then rename: a reader (or a kill) never sees half a file.
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, p)


def load_runs(path: str | Path) -> list[dict[str, Any]]:
    """The runs in a result file: one result, a list of results, or ``{"runs": [...]}``."""
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchmarkError(f"{p}: not a readable result JSON ({exc})") from exc
    runs = data["runs"] if isinstance(data, dict) and "runs" in data else data if isinstance(data, list) else [data]
    if not runs or not all(isinstance(r, dict) for r in runs):
        raise BenchmarkError(f"{p}: expected a benchmark result object, a list of them, or {{'runs': [...]}}")
    return runs


# ------------------------------------------------------------ per-request records


def requests_path_for(result_path: str | Path) -> Path:
    """``r.json`` -> ``r.requests.jsonl``: where a result's per-request records go."""
    p = Path(result_path)
    return p.with_suffix(".requests.jsonl") if p.suffix else p.with_name(p.name + ".requests.jsonl")


class RequestLog:
    """Appends one JSON line per finished request and flushes it at once.

    A line: ``index`` (request order), ``start`` (seconds from the window's start), and
    every field of ``RequestRecord``: ``success``, ``prompt_len``, ``output_len``,
    ``ttft``, ``itl`` (list), ``latency`` (seconds, vLLM's definition), their
    content-based twins ``content_ttft``, ``content_itl``, ``content_latency``,
    ``usage_prompt_tokens``, ``chunks``, ``content_chunks``, ``error``, ``error_kind``.
    """

    def __init__(self, path: str | Path, redact: Any = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._redact = redact
        self._f: IO[str] | None = self.path.open("w", buffering=1)

    def write(self, index: int, record: Any, window_start: float) -> None:
        if self._f is None:
            return
        line = {"index": index, **dataclasses.asdict(record)}
        line["start"] = record.start - window_start if record.start else None
        if self._redact is not None:
            line = self._redact(line)
        self._f.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


# ------------------------------------------------------------ where it was measured


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "Model")):  # x86 / some ARM kernels
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _gpus() -> list[dict[str, Any]]:
    """GPUs as nvidia-smi lists them; none when it is missing or fails (torch is not imported)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3:
            mem = int(parts[1]) if parts[1].isdigit() else None
            gpus.append({"name": parts[0], "memory_mib": mem, "driver": parts[2]})
    return gpus


def _versions() -> dict[str, str]:
    out = {"python": platform.python_version()}
    for dist in _VERSIONED:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


@functools.lru_cache(maxsize=1)
def environment_info() -> dict[str, Any]:
    """Host, OS, CPU, GPUs and library versions; computed once per process."""
    try:
        affinity: int | None = len(os.sched_getaffinity(0))
    except AttributeError:  # not on macOS
        affinity = None
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": affinity,
        "gpus": _gpus(),
        "versions": _versions(),
    }


def git_info(path: str | Path) -> dict[str, Any] | None:
    """``{"commit", "dirty"}`` of the git repository holding ``path``; None outside one.

    ``dirty`` means tracked files differ from the commit; untracked files (logs,
    results) do not count.
    """
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(path), *args], capture_output=True, text=True, timeout=10, check=True).stdout

    try:
        commit = git("rev-parse", "HEAD").strip()
        dirty = bool(git("status", "--porcelain", "--untracked-files=no").strip())
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": dirty}


def workspace_record(workspace: Any) -> dict[str, Any]:
    """Which workspace a result came from: name, path, and its git commit (or None)."""
    return {"name": workspace.name, "path": str(workspace.root), "git": git_info(workspace.root)}


# ------------------------------------------------------------ naming


def backend_name(endpoint: str) -> str:
    """vLLM ``bench serve``'s name for the API spoken."""
    return "openai-chat" if endpoint == "chat" else "openai"



def _name_part(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


def result_filename(backend: str, request_rate: float | str, max_concurrency: int | None, model: str | None,
                    when: datetime | None = None) -> str:
    """vLLM's automatic name: ``{backend}-{rate}qps[-concurrency{N}]-{model}-{YYYYmmdd-HHMMSS}.json``."""
    rate = "inf" if request_rate == "inf" or (isinstance(request_rate, float) and math.isinf(request_rate)) else f"{float(request_rate):g}"
    conc = f"-concurrency{max_concurrency}" if max_concurrency else ""
    base_model = _name_part((model or "unknown").rstrip("/").split("/")[-1])
    stamp = (when or datetime.now()).strftime("%Y%m%d-%H%M%S")
    return f"{_name_part(backend)}-{rate}qps{conc}-{base_model}-{stamp}.json"


def unique_path(path: Path) -> Path:
    """``path``, or ``path`` with ``-2``, ``-3`` ... before the suffix when it exists."""
    if not path.exists():
        return path
    for i in range(2, 10_000):
        candidate = path.with_name(f"{path.stem}-{i}{path.suffix}")
        if not candidate.exists():
            return candidate
    raise BenchmarkError(f"too many results named like {path}")


def redacted(secrets: Iterable[str]) -> Any:
    """A function replacing each secret in a JSON-like value (see ``target.auth.redact``)."""
    from infra_agent.target.auth import redact

    found = list(secrets)
    return lambda obj: redact(obj, found)
