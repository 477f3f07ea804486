"""The MCP session's trace tools: ``analyze_trace`` and ``diff_traces`` over a probe's saved traces.

A timeline probe leaves its traces beside its results (the window's spans, the py-spy
dumps, a Kineto trace); these tools read them again without running anything, as
``infra-agent trace analyze|diff`` does from the command line: ``analyze_trace`` loads one
window's traces onto one clock and returns the analysis (threads, thread states, waits for
the GIL and their holders, findings), ``diff_traces`` ranks the spans by their share of the
end-to-end delta between two windows.  A source is a ``run_probe`` call of this session
(``p1``), one side of an experiment of the ledger, or files under the workspace folder.

A probe that traced several windows (scenarios, A/B pairs) left one set of files each; the
first one (or the one of ``scenario``) is read, and the text names the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Artifact, Feedback
from infra_agent.mcp.probe_tool import FEEDBACK_CHARS
from infra_agent.mcp.tool_args import AnalyzeTraceArgs, DiffTracesArgs, TraceSource
from infra_agent.mcp.views import find_experiment
from infra_agent.safety import bound, confine
from infra_agent.tools.registry import ToolContext, ToolResult

if TYPE_CHECKING:
    from infra_agent.mcp.session import McpSession

# spans-<scenario>.json and gil-<scenario>.jsonl: the timeline probe's names for one window's files.
_WINDOW_FILE = re.compile(r"^(?:spans|gil)-(?P<scenario>.+?)\.jsonl?$")


@dataclass
class Window:
    """One traced window's files."""

    label: str
    spans: list[Path] = field(default_factory=list)
    pyspy: Path | None = None
    kineto: list[Path] = field(default_factory=list)

    def files(self) -> list[str]:
        return [str(p) for p in (*self.spans, *([self.pyspy] if self.pyspy else []), *self.kineto)]


def _source_feedback(session: McpSession, src: TraceSource) -> tuple[Feedback, str]:
    if src.probe_call is not None:
        fb = session.probe_feedback.get(src.probe_call)
        if fb is None:
            known = ", ".join(session.probe_feedback) or "none yet"
            raise InfraAgentError(f"field 'probe_call': expected a run_probe call of this session ({known}), got "
                                  f"{src.probe_call!r}")
        return fb, f"run_probe call {src.probe_call}"
    assert src.experiment is not None
    exp = find_experiment(session, src.experiment, src.run)
    fb = exp.feedback if src.side == "candidate" else exp.baseline_feedback
    if fb is None:
        raise InfraAgentError(f"experiment {exp.id} has no {src.side} feedback (status {exp.status}); its probe did "
                              f"not measure that side")
    return fb, f"experiment {exp.id} ({src.side})"


def _windows(artifacts: list[Artifact]) -> list[Window]:
    """The trace files of a Feedback, one Window per traced window (folder and scenario)."""
    windows: dict[tuple[str, str], Window] = {}
    kineto: dict[str, list[Path]] = {}
    for a in artifacts:
        if a.kind != "trace":
            continue
        path = Path(a.path)
        m = _WINDOW_FILE.match(path.name)
        if m is None:
            if "kineto" in a.description.lower():
                kineto.setdefault(str(path.parent), []).append(path)
            continue  # the merged Perfetto trace: made from these files, not a source of its own
        key = (str(path.parent), m.group("scenario"))
        w = windows.setdefault(key, Window(label=f"{m.group('scenario')} in {path.parent.name}"))
        if path.suffix == ".jsonl":
            w.pyspy = path
        else:
            w.spans.append(path)
    for (folder, _), w in windows.items():
        w.kineto = kineto.get(folder, [])
    return list(windows.values())


def resolve(session: McpSession, src: TraceSource) -> tuple[Window, str, list[str]]:
    """The window to read, what it came from, and the other windows' labels."""
    if src.paths:
        files = [confine(session.ws.root, p) for p in src.paths]
        missing = [p for p, f in zip(src.paths, files) if not f.is_file()]
        if missing:
            raise InfraAgentError(f"field 'paths': no such file under the workspace: {', '.join(missing)}")
        return Window(label="files", spans=files), "files " + ", ".join(src.paths), []
    fb, where = _source_feedback(session, src)
    windows = _windows(fb.artifacts)
    if src.scenario is not None:
        windows = [w for w in windows if w.label.startswith(f"{src.scenario} in ")] or windows[:0]
    if not windows:
        scen = f" of scenario {src.scenario!r}" if src.scenario else ""
        files = sorted({Path(a.path).name for a in fb.artifacts})
        raise InfraAgentError(f"{where} saved no trace{scen}: a {fb.probe} probe saved "
                              + (", ".join(files[:8]) + (f" and {len(files) - 8} more" if len(files) > 8 else "")
                                 if files else "no files")
                              + "; a timeline probe saves a window's spans and py-spy samples")
    return windows[0], where, [w.label for w in windows[1:]]


def analyze_trace(session: McpSession, ctx: ToolContext, args: AnalyzeTraceArgs) -> ToolResult:
    from infra_agent.trace.analyze import analyze
    from infra_agent.trace.feedback import timeline_feedback
    from infra_agent.trace.load import load_timeline

    window, where, others = resolve(session, args)
    pairs = []
    for pair in args.expect_overlap:
        a, sep, b = pair.partition(":")
        if not (sep and a and b):
            return ToolResult.fail(f"analyze_trace: field 'expect_overlap': expected 'A:B', got {pair!r}",
                                   problem="invalid_arguments")
        pairs.append((a, b))
    tl = load_timeline(window.spans, pyspy=window.pyspy, kineto=window.kineto)
    report = analyze(tl, by=args.by, expect_overlap=pairs)
    fb = timeline_feedback(report)
    lines = [f"trace of {where}, window {window.label}: {_ms(report.window[1] - report.window[0])} ms, "
             f"{len(report.threads)} thread(s) with spans, {report.samples} py-spy sample(s)"]
    lines += [f"other traced windows: {', '.join(others)} (name one with scenario)"] if others else []
    lines += [f"warning: {w}" for w in report.warnings]
    lines += _report_lines(report)
    data = {"source": where, "window": window.label, "files": window.files(), "other_windows": others,
            "report": _small_report(report),
            "findings": [f.model_dump(mode="json", exclude_none=True) for f in fb.findings],
            "measurements": [{"name": m.name, "unit": m.unit, "value": m.summary.median if m.summary else None,
                              "tags": dict(m.tags)} for m in fb.measurements]}
    text = "\n".join(lines) + "\n" + fb.render_text()
    return ToolResult(text=bound(text, FEEDBACK_CHARS), data=data)


def diff_traces(session: McpSession, ctx: ToolContext, args: DiffTracesArgs) -> ToolResult:
    from infra_agent.trace.diff import diff, diff_findings
    from infra_agent.trace.load import load_timeline

    if args.experiment is not None:
        a_src = TraceSource(experiment=args.experiment, run=args.run, side="baseline", scenario=args.scenario)
        b_src = a_src.model_copy(update={"side": "candidate"})
    else:
        assert args.baseline is not None and args.candidate is not None
        a_src, b_src = args.baseline, args.candidate
    (a, a_where, _), (b, b_where, _) = resolve(session, a_src), resolve(session, b_src)
    for w, where in ((a, a_where), (b, b_where)):
        if not w.spans:
            raise InfraAgentError(f"{where} has no span trace in window {w.label} (a diff compares spans; its py-spy "
                                  "samples alone can be read with analyze_trace)")
    d = diff(load_timeline(a.spans), load_timeline(b.spans), per=args.per)
    found = diff_findings(d)
    unit = f" per {d.per}" if d.per else ""
    lines = [f"A = {a_where} ({a.label}), B = {b_where} ({b.label})",
             f"E2E{unit}: {_ms(d.e2e_a_us)} -> {_ms(d.e2e_b_us)} ms (delta {_ms(d.e2e_delta_us)} ms)"]
    for title, rows in (("spans (self time)", d.spans), ("categories", d.categories)):
        lines.append(f"{title}: name, A ms, B ms, delta ms, share of the delta")
        for r in rows[:12]:
            share = d.share(r)
            lines.append(f"  {r.key}: {_ms(r.a_us)} {_ms(r.b_us)} {_ms(r.delta_us)} "
                         + (f"{100 * share:.0f}%" if share is not None else "-"))
    lines += [f"F[{f.severity}] {f.kind}: {f.message}" for f in found]
    full = d.to_dict()
    data = {"baseline": {"source": a_where, "window": a.label, "files": a.files()},
            "candidate": {"source": b_where, "window": b.label, "files": b.files()},
            "diff": {**full, "spans": full["spans"][:40], "categories": full["categories"][:40]},  # type: ignore[index]
            "findings": [f.model_dump(mode="json", exclude_none=True) for f in found]}
    return ToolResult(text=bound("\n".join(lines), FEEDBACK_CHARS), data=data)


# ---------------------------------------------------------------- rendering


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _report_lines(report: Any) -> list[str]:
    lines = []
    for th in report.threads[:8]:
        lines.append(f"thread {th.thread}: busy {100 * th.busy_share:.0f}% ({_ms(th.busy_us)} ms), waiting for the "
                     f"GIL {_ms(th.waiting_us)} ms, {th.spans} spans")
    states = report.thread_states
    for t in (states.threads[:8] if states is not None else []):
        shares = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(t.shares.items(), key=lambda kv: -kv[1])[:4])
        site = next(iter(t.blocked_sites()), None)
        where = f"; blocked most in {site.function} {site.where}" + (f" ({site.waits_in})" if site.waits_in else "") \
            if site is not None else ""
        lines.append(f"states of {t.thread}{' (' + t.role + ')' if t.role else ''}: {shares}{where}")
    for w in report.waits[:4]:
        h = w.holders[0] if w.holders else None
        lines.append(f"wait {w.group}@{w.thread}: {100 * w.waiting_share:.0f}% of {_ms(w.span_us)} ms without the GIL"
                     + (f"; held by {h.thread} in {h.function} {h.where}" if h is not None else ""))
    return lines


def _small_report(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    states = report.thread_states
    return {"duration_us": d["duration_us"], "samples": d["samples"], "warnings": d["warnings"],
            "sources": d["sources"], "threads": d["threads"][:16], "waits": d["waits"][:8],
            "expected_overlap": d["expected_overlap"], "holder_spans": d["holder_spans"],
            "thread_states": [{**t.to_dict(), "sites": [c.to_dict() for c in t.sites[:4]]} for t in states.threads[:16]]
            if states is not None else []}


__all__ = ["Window", "analyze_trace", "diff_traces", "resolve"]
