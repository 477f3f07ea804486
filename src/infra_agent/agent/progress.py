"""The live view of a run: the current experiment, its probe and tier, the best so far, the gates.

On a terminal it is a rich ``Live`` panel; in CI logs and files (no TTY) it is plain
lines, one per event, so a long run is never silent.  What it shows (a hypothesis the
model wrote, a probe's error with a server's log in it) is masked of secrets first.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Mapping
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from infra_agent.records import EXACT_COUNT, Experiment, GateResult
from infra_agent.safety import scrub_text

_COLOUR = {"pass": "green", "fail": "red", "inconclusive": "yellow", "error": "red", "skipped": "dim",
           "supported": "green", "refuted": "red", "baseline": "cyan", "confirmed": "green", "not_confirmed": "red"}


def gate_table(gates: list[GateResult], title: str = "gates") -> Table:
    t = Table(title=title, title_justify="left", expand=False)
    for col in ("gate", "criterion", "outcome", "value \\[interval]", "measured in"):
        t.add_column(col)
    for g in gates:
        val = "-" if g.value is None else f"{g.value:.4g}"
        if g.low is not None and g.high is not None and g.interval not in ("", EXACT_COUNT):
            val += f" [{g.low:.4g}, {g.high:.4g}]"
        t.add_row(g.name, g.gate, Text(g.outcome, style=_COLOUR.get(g.outcome, "")), val, g.measured_in or "-")
    return t


def server_start_text(ev: Mapping[str, Any]) -> str:
    """A worker's ``start`` event: a kept server (executors/server_pool.py) is attached, not started;
    say which, since launches are what a slow-starting engine makes expensive."""
    side = str(ev.get("side", "")).upper()
    return f"server {side}: kept up, attached" if ev.get("kept") else f"starting server {side}"


class RunProgress:
    def __init__(self, console: Console | None, enabled: bool = True) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = enabled
        self.live_mode = enabled and self.console.is_terminal
        self.current: str = ""
        self.detail: str = ""
        self.best: str = "baseline"
        self.gates: list[GateResult] = []
        self.started = time.monotonic()
        self._live: Live | None = None

    def __enter__(self) -> RunProgress:
        if self.live_mode:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None

    def _render(self) -> Group:
        head = Text.assemble(("experiment ", "bold"), scrub_text(self.current or "-"), "\n", ("probe ", "bold"),
                             scrub_text(self.detail or "-"), "\n", ("best ", "bold"), scrub_text(self.best),
                             f"   ({time.monotonic() - self.started:.0f} s)")
        return Group(head, gate_table(self.gates, "gate table (best so far)"))

    def _update(self) -> None:
        if self._live is not None:
            self._live.update(self._render())

    def line(self, text: str) -> None:
        if not self.enabled:
            return
        text = scrub_text(text)
        if self._live is not None:
            self._live.console.print(text, markup=False, highlight=False)
        else:
            print(f"[{time.monotonic() - self.started:6.1f}s] {text}", file=sys.stderr, flush=True)

    def experiment(self, exp: Experiment, probe: str) -> None:
        self.current = f"{exp.id}: {exp.hypothesis.statement}"
        self.detail = probe
        change = ", ".join(f"{k}={v}" for k, v in exp.change.knobs.items()) + (" + diff" if exp.change.diff else "")
        self.line(f"{exp.id} start: {exp.hypothesis.statement}" + (f" | change {change}" if change else "") + f" | {probe}")
        self._update()

    def event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        if kind == "run":
            thr = ev.get("output_throughput")
            txt = f"  {ev.get('scenario')} pair {int(ev.get('pair', 0)) + 1} side {str(ev.get('side')).upper()}: " + \
                  (f"{thr:.1f} tok/s" if isinstance(thr, (int, float)) else ("ok" if ev.get("ok") else f"failed: {ev.get('error')}"))
        elif kind == "start":
            txt = f"  {server_start_text(ev)}"
        elif kind == "probe":
            txt = f"  probe {ev.get('probe')}: {'ok' if ev.get('ok') else 'FAILED ' + str(ev.get('error'))[:200]}"
        else:
            return
        self.detail = txt.strip()
        self.line(txt)
        self._update()

    def finished(self, exp: Experiment, best: Experiment, gates: list[GateResult]) -> None:
        v = exp.verdict
        outcome = v.outcome if v else "no verdict"
        from infra_agent.judge.effect_text import effect_text

        effect = f" {effect_text(exp)}".rstrip()
        self.line(f"{exp.id} {exp.status}: {outcome}{effect} in {exp.cost.wall_s:.1f} s"
                  + (f" — {v.message}" if v else f" — {exp.error or ''}"))
        self.best = f"{best.id} ({best.knobs if best.role != 'baseline' else 'baseline'})"
        self.gates = gates
        self._update()
