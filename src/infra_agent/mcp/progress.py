"""Progress of an MCP session's long calls: the loop's progress view and a heartbeat, both
sent to the current tool call's progress sink (``McpSession.report``) instead of a terminal."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from infra_agent.agent.progress import RunProgress, server_start_text
from infra_agent.records import Experiment

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession


class SinkProgress(RunProgress):
    """The loop's progress view, sent to the current call's progress sink instead of a terminal."""

    def __init__(self, session: McpSession) -> None:
        super().__init__(None, enabled=False)
        self._session = session

    def line(self, text: str) -> None:
        self._session.report(text)

    def event(self, ev: dict[str, Any]) -> None:
        self._session.report(describe_event(ev))

    def experiment(self, exp: Experiment, probe: str) -> None:
        self._session.report(f"{exp.id} start: {exp.hypothesis.statement} | {probe}")

    def finished(self, exp: Experiment, best: Experiment, gates: list[Any]) -> None:
        v = exp.verdict
        outcome = v.outcome if v else exp.status
        self._session.report(f"{exp.id} {outcome}{' (accepted)' if v and v.accepted else ''}; best is {best.id}")


def describe_event(ev: Mapping[str, Any]) -> str:
    """One worker event (``start``, ``run``, ``probe``) as a line of progress."""
    kind = ev.get("event")
    if kind == "start":
        return server_start_text(ev)
    if kind == "run":
        thr = ev.get("output_throughput")
        res = f"{thr:.1f} tok/s" if isinstance(thr, (int, float)) else ("ok" if ev.get("ok") else f"failed: {ev.get('error')}")
        return f"{ev.get('scenario')} window {int(ev.get('pair', 0)) + 1} side {str(ev.get('side', '')).upper()}: {res}"
    if kind == "probe":
        return f"probe {ev.get('probe')}: " + ("ok" if ev.get("ok") else f"failed: {str(ev.get('error'))[:200]}")
    return str(dict(ev))[:200]


class Heartbeat:
    """Reports ``what`` every ``every_s`` seconds until closed."""

    def __init__(self, session: McpSession, what: str, every_s: float) -> None:
        self._stop = threading.Event()
        self._t0 = time.monotonic()
        self._thread = threading.Thread(target=self._beat, args=(session, what, every_s), daemon=True)
        self._thread.start()

    def _beat(self, session: McpSession, what: str, every_s: float) -> None:
        while not self._stop.wait(every_s):
            session.report(f"{what}: running, {time.monotonic() - self._t0:.0f} s")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=1)
