"""``infra-agent trace analyze|diff``: timeline analysis of span, py-spy and Kineto traces.

Light at import (see cli/main.py): the analysis modules load inside the commands.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer
from rich.table import Table

from infra_agent.cli.output import emit, user_errors

if TYPE_CHECKING:
    from infra_agent.trace.analyze import TimelineReport
    from infra_agent.trace.diff import TimelineDiff

HELP = "Timeline analysis: overlap, GIL attribution, critical path, trends and diffs of traces."


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _pairs(values: list[str] | None, sep: str, what: str) -> list[tuple[str, str]]:
    out = []
    for v in values or []:
        a, s, b = v.partition(sep)
        if not s or not a or not b:
            raise typer.BadParameter(f"expected {what}, got {v!r}")
        out.append((a, b))
    return out


def _render_report(report: TimelineReport, fb: Any, con: Any) -> None:
    lo, hi = report.window
    con.print(f"[bold]window[/] {_ms(hi - lo)} ms, {len(report.threads)} thread(s), {report.samples} py-spy sample(s)")
    for src in report.sources:
        clock = src.get("clock", {})
        con.print(f"  {src['format']:7} {src['path']}  ({clock.get('how', '')})")
    for w in report.warnings:
        con.print(f"[yellow]warning:[/] {w}")
    if report.threads:  # threads with spans; a server without spans has its thread states below
        t = Table(title="threads", title_justify="left")
        for col in ("thread", "busy ms", "idle ms", "waiting ms", "busy", "spans"):
            t.add_column(col, justify="left" if col == "thread" else "right")
        for th in report.threads:
            t.add_row(th.thread, _ms(th.busy_us), _ms(th.idle_us), _ms(th.waiting_us), _pct(th.busy_share),
                      str(th.spans))
        con.print(t)
    if report.streams:
        t = Table(title="GPU streams (Kineto device events)", title_justify="left")
        for col in ("stream", "events", "busy ms", "of", "busy", "median us"):
            t.add_column(col, justify="left" if col in ("stream", "of") else "right")
        for r in report.streams:
            t.add_row(r.stream, str(r.kernels), _ms(r.busy_us), f"{r.reference} ({_ms(r.reference_us)} ms)",
                      _pct(r.busy_share), f"{r.median_kernel_us:.1f}")
        con.print(t)
    m = report.overlap
    if m.note:
        con.print(f"[bold]overlap[/]: {m.note}")
    else:
        labels = sorted({p.a for p in m.pairs} | {p.b for p in m.pairs}, key=lambda g: -m.groups[g])[:10]
        t = Table(title=f"overlap (by {m.by}): share of the row's time the column was active on another thread",
                  title_justify="left")
        t.add_column("group@thread")
        t.add_column("ms", justify="right")
        for g in labels:
            t.add_column(g, justify="right")
        for a in labels:
            cells = []
            for b in labels:
                p = m.pair(a, b) if a != b else None
                cells.append(_pct(p.share_of_a) if p else ("·" if a == b or m.threads[a] == m.threads[b] else "0%"))
            t.add_row(a, _ms(m.groups[a]), *cells)
        con.print(t)
    for lo in m.layers:  # a layer-wise KV transfer: each layer's send beside the later layers' compute
        con.print(f"[bold]layer {lo.layer} transfer[/] ({', '.join(lo.threads)}): {_pct(lo.share)} beside a later "
                  f"layer's compute ({_ms(lo.overlap_us)} of {_ms(lo.transfer_us)} ms)")
    for e in report.expected:
        con.print(f"[bold]expected overlap[/] {e.a} with {e.b}: {_pct(e.share_of_a)} ({_ms(e.both_us)} of {_ms(e.a_us)} ms)")
    if report.waits:
        t = Table(title="waiting (no GIL) and who held it", title_justify="left")
        for col in ("group@thread", "span ms", "waited", "holder", "where", "share"):
            t.add_column(col, justify="right" if col in ("span ms", "waited", "share") else "left")
        for wr in report.waits[:12]:
            h = wr.holders[0] if wr.holders else None
            t.add_row(f"{wr.group}@{wr.thread}", _ms(wr.span_us), _pct(wr.waiting_share), h.thread if h else "-",
                      f"{h.function} {h.where}" if h else "-", _pct(h.share) if h else "-")
        con.print(t)
    _render_states(report, con)
    if report.paths:
        durs = sorted(p.end_us - p.start_us for p in report.paths)
        con.print(f"[bold]critical paths[/]: {len(report.paths)} request(s), median {_ms(durs[len(durs) // 2])} ms; "
                  f"first: " + ", ".join(f"{k} {_pct(v)}" for k, v in list(report.paths[0].shares().items())[:5]))
    for tr in [x for x in report.trends if x.rising][:5]:
        con.print(f"[bold]trend[/] {tr.describe()}")
    ss = report.step_shares
    if ss is not None and ss.step_us > 0:
        parts = ", ".join(f"{k} {_pct(v / ss.step_us)}" for k, v in list(ss.by_name.items())[:5])
        con.print(f"[bold]{ss.step_span}[/] x{ss.steps}: model {_pct(ss.model_us / ss.step_us)}, non-model "
                  f"{_pct(ss.non_model_share)} ({parts}; untraced {_pct(ss.untraced_us / ss.step_us)})")
    con.print(fb.render_text(), markup=False, highlight=False)


def _render_states(report: TimelineReport, con: Any) -> None:
    """Every dump-sampled thread: its shares by state and the call site it was blocked in most."""
    ts = report.thread_states
    if ts is None or not ts.threads:
        if ts is not None and ts.note:
            con.print(f"[bold]thread states[/]: {ts.note}")
        return
    t = Table(title=f"thread states ({ts.snapshots} py-spy dumps): share of each thread's sampled time",
              title_justify="left")
    for col in ("thread", "role", "running", "gil wait", "native", "blocked", "idle", "top blocked call site"):
        t.add_column(col, justify="left" if col in ("thread", "role", "top blocked call site") else "right")
    for th in ts.threads:
        s = th.shares
        site = next(iter(th.blocked_sites()), None)
        where = (f"{_pct(site.share)} {site.label.partition(':')[2]} {site.waits_in or ''} @ {site.function} "
                 f"{site.where}" if site else "-")
        t.add_row(th.thread, th.role or "-", _pct(s.get("running", 0.0)), _pct(s.get("gil_wait", 0.0)),
                  _pct(s.get("native", 0.0)), _pct(th.blocked_share), _pct(s.get("idle", 0.0)), where)
    con.print(t)


def _render_diff(d: TimelineDiff, con: Any) -> None:
    unit = f" per {d.per}" if d.per else ""
    con.print(f"[bold]E2E[/]{unit}: {_ms(d.e2e_a_us)} → {_ms(d.e2e_b_us)} ms (delta {_ms(d.e2e_delta_us)} ms)")
    for title, rows in (("spans (self time)", d.spans), ("categories", d.categories)):
        t = Table(title=title, title_justify="left")
        for col in ("name", "A ms", "B ms", "delta ms", "share of delta"):
            t.add_column(col, justify="left" if col == "name" else "right")
        for r in rows[:15]:
            share = d.share(r)
            t.add_row(r.key, _ms(r.a_us), _ms(r.b_us), _ms(r.delta_us), _pct(share) if share is not None else "-")
        con.print(t)


def register(app: typer.Typer) -> None:
    trace = typer.Typer(help=HELP, no_args_is_help=True)

    @trace.command("analyze")
    def analyze_cmd(
        traces: list[Path] | None = typer.Argument(None, help="Span traces (Chrome trace JSON: ours, or Kineto); "
                                                   "none for a server without spans, with --pyspy."),
        pyspy: Path | None = typer.Option(None, "--pyspy", help="py-spy samples: dumps (JSON lines, every thread's "
                                          "state) or record --format chrometrace --gil --idle output."),
        kineto: list[Path] | None = typer.Option(None, "--kineto", help="PyTorch profiler trace (repeatable)."),
        pyspy_start_unix_ns: int | None = typer.Option(None, "--pyspy-start-unix-ns", help="Unix ns at which py-spy started sampling (default: file mtime minus its last ts)."),
        pyspy_offset_us: float = typer.Option(0.0, "--pyspy-offset-us", help="Shift py-spy samples by this many µs."),
        by: str = typer.Option("cat", "--by", help="Group spans by 'cat' or 'name'."),
        expect_overlap: list[str] | None = typer.Option(None, "--expect-overlap", help="A:B, span names or categories ('|' joins several) that should overlap (repeatable)."),
        knob_hint: list[str] | None = typer.Option(None, "--knob-hint", help="PATTERN=KNOB: name KNOB in findings whose file, function or span contains PATTERN (repeatable)."),
        serving_result: Path | None = typer.Option(None, "--serving-result", help="A serving result JSON (per-request itls) for per-position latency."),
        merged: Path | None = typer.Option(None, "--merged", help="Write all sources as one Chrome trace here (Perfetto opens it)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Overlap matrix, per-thread time, GIL holders during waits, thread states, critical paths, trends."""
        if by not in ("cat", "name"):
            raise typer.BadParameter(f"expected 'cat' or 'name', got {by!r}", param_hint="--by")
        if not traces and pyspy is None:
            raise typer.BadParameter("give a span trace, or py-spy samples alone with --pyspy FILE", param_hint="TRACES")
        pairs = _pairs(expect_overlap, ":", "A:B")
        hints = dict(_pairs(knob_hint, "=", "PATTERN=KNOB"))
        with user_errors(as_json):
            from infra_agent.trace.analyze import analyze
            from infra_agent.trace.feedback import timeline_feedback
            from infra_agent.trace.load import load_timeline, read_json

            tl = load_timeline(traces or [], pyspy=pyspy, kineto=kineto or [], pyspy_start_unix_ns=pyspy_start_unix_ns,
                               pyspy_offset_us=pyspy_offset_us)
            result = read_json(serving_result) if serving_result else None
            report = analyze(tl, by=by, expect_overlap=pairs)
            fb = timeline_feedback(report, knob_hints=hints, serving_result=result)
            if merged:
                from infra_agent.trace.merge import write_merged

                write_merged(tl, merged)
        out = {"report": report.to_dict(), "feedback": json.loads(fb.to_json())}
        if merged:
            out["merged"] = str(merged)

        def show(con: Any) -> None:
            _render_report(report, fb, con)
            if merged:
                con.print(f"merged trace: {merged}")

        emit(out, as_json, show)

    @trace.command("diff")
    def diff_cmd(
        a: Path = typer.Argument(..., help="Baseline run's span trace."),
        b: Path = typer.Argument(..., help="Candidate run's span trace."),
        per: str | None = typer.Option(None, "--per", help="Compare per occurrence of this span (e.g. engine.step)."),
        as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    ) -> None:
        """Rank spans and categories by their share of the E2E delta between two runs."""
        with user_errors(as_json):
            from infra_agent.trace.diff import diff, diff_findings
            from infra_agent.trace.load import load_timeline

            d = diff(load_timeline([a]), load_timeline([b]), per=per)
            found = [f.model_dump(mode="json") for f in diff_findings(d)]
        emit({"diff": d.to_dict(), "findings": found}, as_json, lambda con: _render_diff(d, con))

    app.add_typer(trace, name="trace")
