"""Synthetic py-spy dumps, as ``PySpyDumpSampler`` writes them (innermost frame first), over
a real source file: a C call such as ``time.sleep`` leaves no frame, and its kind is read
from the caller's line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .synth import ORIGIN_NS

LIB = "/usr/lib/python3.11"
APP = """\
import asyncio, queue, threading, time

async def handle(reader, writer):
    time.sleep(0.05)
    await asyncio.sleep(0.05)

def compute(n):
    return sum(i * i for i in range(n))

def step(q):
    return q.get()

def guarded(self):
    with self._lock:
        pass

def submit(self):
    with self._wake:
        self._wake.notify()
"""
SLEEP_LINE, AWAIT_LINE, COMPUTE_LINE, GET_LINE, LOCK_LINE, WITH_LINE = 4, 5, 8, 11, 14, 18


def app_file(tmp_path: Path) -> str:
    path = tmp_path / "app.py"
    path.write_text(APP)
    return str(path)


def frame(name: str, file: str, line: int) -> dict[str, Any]:
    return {"name": name, "filename": file, "line": line}


def loop_under(app: str, *inner: dict[str, Any]) -> list[dict[str, Any]]:
    """An asyncio.run() stack, innermost first as py-spy writes it, with ``inner`` on top."""
    return [*inner,
            frame("BaseEventLoop._run_once", f"{LIB}/asyncio/base_events.py", 1922),
            frame("BaseEventLoop.run_forever", f"{LIB}/asyncio/base_events.py", 607),
            frame("BaseEventLoop.run_until_complete", f"{LIB}/asyncio/base_events.py", 640),
            frame("Runner.run", f"{LIB}/asyncio/runners.py", 118), frame("run", f"{LIB}/asyncio/runners.py", 190),
            frame("<module>", app, 20)]


def thread_under(target: str, app: str, line: int, *inner: dict[str, Any]) -> list[dict[str, Any]]:
    return [*inner, frame(target, app, line), frame("Thread.run", f"{LIB}/threading.py", 982),
            frame("Thread._bootstrap_inner", f"{LIB}/threading.py", 1045),
            frame("Thread._bootstrap", f"{LIB}/threading.py", 1002)]


def thread(name: str, tid: int, frames: list[dict[str, Any]], gil: bool = False, active: bool = False) -> dict[str, Any]:
    return {"thread_name": name, "os_thread_id": tid, "owns_gil": gil, "active": active, "frames": frames}


def write_dumps(path: Path, snapshots: list[list[dict[str, Any]]], every_us: int = 10_000, start_us: int = 0) -> Path:
    stamp = [ORIGIN_NS + (start_us + i * every_us) * 1000 for i in range(len(snapshots))]
    path.write_text("".join(json.dumps({"ts_unix_ns": ts, "threads": threads}) + "\n"
                            for ts, threads in zip(stamp, snapshots, strict=True)))
    return path


def asyncio_server(app: str, blocking: bool, n: int = 40) -> list[list[dict[str, Any]]]:
    """An asyncio server's loop thread and a worker thread.  Three snapshots in five the loop is
    in its handler's time.sleep (blocking) or awaits asyncio.sleep, idle in the selector (clean);
    meanwhile the worker holds the GIL in compute()."""
    out = []
    for i in range(n):
        busy = i % 5 < 3
        if busy and blocking:
            loop = loop_under(app, frame("handle", app, SLEEP_LINE), frame("Handle._run", f"{LIB}/asyncio/events.py", 80))
        else:
            loop = loop_under(app, frame("EpollSelector.select", f"{LIB}/selectors.py", 468))
        out.append([thread("MainThread", 1, loop),
                    thread("worker", 2, thread_under("compute", app, COMPUTE_LINE), gil=busy, active=busy)])
    return out
