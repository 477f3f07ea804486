"""The self-contained HTML report: inline CSS and SVG, no scripts, no external resources."""

from __future__ import annotations

from html import escape

from infra_agent.records import Experiment, RunRecord
from infra_agent.report.decisions import OUTCOME_LABELS
from infra_agent.report.model import (
    ExperimentView,
    FindingView,
    GateCell,
    ReportModel,
    build_model,
)
from infra_agent.report.noise import NOT_RECORDED
from infra_agent.report.plot import render_svg
from infra_agent.report.ratio_plot import render_ratio_svg
from infra_agent.report.style import CSS

_GREEN = {"pass", "supported", "done", "accepted", "confirmed"}
_RED = {"fail", "refuted", "error", "rejected", "timeout", "not_confirmed"}
_DASH = '<span class="muted">–</span>'
_AMBER = {"inconclusive", "running", "interrupted", "budget", "warning", "proposed"}


def e(text: object) -> str:
    return escape("" if text is None else str(text), quote=True)


def badge(word: str, title: str = "") -> str:
    cls = "b-green" if word in _GREEN else "b-red" if word in _RED else "b-amber" if word in _AMBER else "b-grey"
    tip = f' title="{e(title)}"' if title else ""
    return f'<span class="badge {cls}"{tip}>{e(word)}</span>'


def _code(text: str) -> str:
    return f"<code>{e(text)}</code>" if text else _DASH


def _knobs(knobs: list[tuple[str, str]]) -> str:
    return " ".join(f'<span class="knob">{e(k)}={e(v)}</span>' for k, v in knobs)


def _diff(diff: str) -> str:
    lines = []
    for line in diff.rstrip("\n").split("\n"):
        cls = ("file" if line.startswith(("+++", "---", "diff ")) else "add" if line.startswith("+")
               else "del" if line.startswith("-") else "hunk" if line.startswith("@@") else "")
        lines.append(f'<span class="{cls}">{e(line)}</span>' if cls else e(line))
    return '<pre class="diff">' + "\n".join(lines) + "</pre>"


def _cell(c: GateCell | None) -> str:
    if c is None:
        return '<span class="muted">not evaluated</span>'
    parts = [badge(c.outcome, c.message), f' <span class="num">{e(c.value)}</span>']
    if c.interval:
        parts.append(f' <span class="ci">{e(c.interval)}</span>')
    if c.label:
        parts.append(f'<span class="label">interval: {e(c.label)}</span>')
    if c.measured_in:
        parts.append(f'<span class="label">measured in <a href="#exp-{e(c.measured_in)}">{e(c.measured_in)}</a></span>')
    if c.message and c.outcome != "pass":
        parts.append(f'<span class="label">{e(c.message)}</span>')
    return "".join(parts)


def _gates(m: ReportModel) -> str:
    if not m.gates:
        return '<p class="note">No gates were evaluated.</p>'
    rows = [f"<tr><td><strong>{e(g.name)}</strong><span class=\"label\">{e(g.kind)}</span></td>"
            f"<td>{_code(g.gate)}</td><td>{_cell(g.before)}</td><td>{_cell(g.after)}</td></tr>" for g in m.gates]
    return ('<table class="gates"><thead><tr><th>Gate</th><th>Condition</th><th>Before</th><th>After</th></tr>'
            "</thead><tbody>" + "".join(rows) + "</tbody></table>")


def _verdict_short(x: ExperimentView) -> str:
    if not x.verdict:
        return '<span class="muted">no verdict</span>'
    out = badge(x.verdict, x.verdict_message)
    if x.effect != "–" and x.effect:
        out += f' <span class="num">{e(x.effect)}</span> <span class="ci">{e(x.effect_interval)}</span>'
    return out


def _tree(m: ReportModel) -> str:
    rows = []
    for x in m.experiments:
        marks = []
        if x.baseline:
            marks.append('<span class="badge b-grey">baseline</span>')
        if x.accepted:
            marks.append('<span class="badge b-solid">✓ accepted</span>')
        if x.best:
            marks.append('<span class="badge b-green">best</span>')
        cls = "on-path" if x.on_path else "evidence"
        probe = f"{e(x.probe)} {badge(x.probe_tier)}" if x.probe else _DASH
        change = " ".join(p for p in (_knobs(x.knobs), '<span class="badge b-grey">diff</span>' if x.diff else "") if p)
        gate_txt = "" if x.baseline else f'<span class="label"><code>{e(x.hypothesis_gate)}</code></span>'
        rows.append(
            f'<tr class="{cls}"><td class="id"><span class="glyph">{e(x.glyph)}</span>'
            f'<a href="#exp-{e(x.id)}">{e(x.id)}</a> <span class="muted">#{x.seq}</span><br>{"".join(marks)}</td>'
            f"<td>{e(x.statement)}{gate_txt}</td>"
            f"<td>{change or _DASH}</td><td>{probe}</td><td>{badge(x.status)}</td>"
            f"<td>{_verdict_short(x)}</td>"
            f'<td class="num">{e(x.wall)}<span class="label">{x.e2e_runs} e2e{_launches(x.launches, " · ")} · '
            f'{x.llm_tokens:,} tok</span></td></tr>')
    head = ("<tr><th>Experiment</th><th>Hypothesis</th><th>Change</th><th>Probe</th><th>Status</th>"
            "<th>Verdict · effect</th><th>Cost</th></tr>")
    return f'<table class="tree"><thead>{head}</thead><tbody>{"".join(rows)}</tbody></table>'


def _decisions(m: ReportModel) -> str:
    d = m.decisions
    head = "<h2>Decisions: each experiment's ratio against its parent</h2>"
    svg = render_ratio_svg(d)
    if not svg:
        return f'<section id="decisions">{head}<p class="note">{e(d.note or "Nothing to plot.")}</p></section>'
    tally = [(label, sum(x.outcome == o for x in d.items)) for o, label in OUTCOME_LABELS.items()]
    counts = " · ".join(f"{n} {label}" for label, n in tally if n)
    sub = ('<p class="muted small">What each verdict was decided on: the ratio candidate / parent of the '
           "hypothesis metric, from windows measured interleaved (A B A B), with its interval (hover a point for "
           "what the interval is and the machine load). The dashed tick at each point is the line its hypothesis "
           "needed (1 + min effect when higher is better, 1 / (1 + min effect) when lower is); the hypothesis is "
           "supported when the whole interval lies on the shaded side, refuted when it lies wholly on the other. "
           "The star (column \"confirm\") is the confirmation, the best against the baseline. A count (such as "
           f"failed_checks) is decided exactly and shown in its own row.</p><p class=\"small\">{e(counts)}</p>")
    return f'<section id="decisions">{head}{sub}<div class="plot-wrap">{svg}</div></section>'


def _plot(m: ReportModel) -> str:
    """The secondary view, at the end: the absolute metric per experiment, against an absolute criterion."""
    s = m.series
    svg = render_svg(s)
    head = (f"<h2>Best {e(s.metric) or 'metric'} over experiments "
            '<span class="muted small">(absolute, context)</span></h2>')
    if not svg:
        return f'<section id="plot">{head}<p class="note">{e(s.note or "Nothing to plot.")}</p></section>'
    scen = f" in scenario <code>{e(s.scenario)}</code>" if s.scenario else ""
    sub = (f'<p class="muted small">The candidate\'s median <code>{e(s.metric)}</code>{scen} per experiment '
           f"({e(s.direction)} is better); the step line is the best so far. Chosen as {e(s.source)}. Context for "
           "the absolute criterion only: these medians come from windows measured at different times, so a point "
           "above another is not a decision: the decisions plot at the top is.</p>")
    return f'<section id="plot">{head}{sub}<div class="plot-wrap">{svg}</div></section>'


def _accepted(m: ReportModel) -> str:
    acc = m.accepted
    parts = ['<section id="changes"><h2>Accepted changes</h2>']
    if not acc:
        parts.append('<p class="note">No change was accepted: the baseline is still the best.</p>')
    for x in acc:
        parts.append(f'<h3><a href="#exp-{e(x.id)}">{e(x.id)}</a> <span class="muted">#{x.seq}</span> — '
                     f"{e(x.description or x.statement)}</h3>")
        if x.knobs:
            parts.append(f"<p>{_knobs(x.knobs)}</p>")
        parts.append(_diff(x.diff) if x.diff else '<p class="muted small">No code change (knobs only).</p>')
    if m.best_knobs:
        parts.append(f'<h3>Best configuration ({e(m.best)})</h3><p>{_knobs(m.best_knobs)}</p>')
    parts.append("</section>")
    return "".join(parts)


def _finding(f: FindingView) -> str:
    loc = f' <span class="muted">@</span> <code>{e(f.location)}</code>' if f.location else ""
    ev = f'<div class="small muted mono">{e(f.evidence)}</div>' if f.evidence else ""
    nq = f'<div class="next">next: {e(f.next_question)}</div>' if f.next_question else ""
    sev = {"error": "fail", "warning": "warning"}.get(f.severity, "info")
    return (f'<li><span class="badge {"b-red" if sev == "fail" else "b-amber" if sev == "warning" else "b-grey"}">'
            f"{e(f.severity)}</span> <code>{e(f.kind)}</code> {e(f.message)}{loc}{ev}{nq}</li>")


def _card(x: ExperimentView) -> str:
    hyp = [("metric", _code(x.metric)), ("direction", e(x.direction)), ("min effect", e(x.min_effect)),
           ("scenario", _code(x.scenario)), ("locality", _code(x.locality if x.locality != "-" else ""))]
    if not x.baseline:
        hyp.append(("as a gate", _code(x.hypothesis_gate)))
    probe = (_kv([("probe", _code(x.probe)), ("tier", badge(x.probe_tier)), ("reason", e(x.probe_reason) or "–")]
                 + ([("config", _code(x.probe_config))] if x.probe_config else [])
                 + ([("ray node", e(x.node))] if x.node else []))
             if x.probe else '<p class="muted small">Not run.</p>')
    change = [f"<p>{e(x.description)}</p>" if x.description else "", f"<p>{_knobs(x.knobs)}</p>" if x.knobs else ""]
    if x.diff:
        n = x.diff.rstrip("\n").count("\n") + 1
        change.append(f"<details><summary>diff ({n} lines)</summary>{_diff(x.diff)}</details>")
    if not any(change):
        change.append('<p class="muted small">No change (the parent\'s configuration).</p>')
    verdict = [f"<p>{_verdict_short(x)}"
               + (f' <span class="label">effect interval: {e(x.effect_label)}</span>' if x.effect_label else "")
               + "</p>"]
    if x.verdict_message:
        verdict.append(f'<p class="small">{e(x.verdict_message)}</p>')
    if x.noise.measured:
        verdict.append("<h4>Noise</h4>" + _kv([("interval width", e(x.noise.interval)),
                                             ("foreign CPU", _not_recorded(x.noise.foreign_cpu)),
                                             ("load (1 min)", _not_recorded(x.noise.load))]))
    if x.gates:
        verdict.append('<table class="small vgates"><thead><tr><th>Gate</th><th>Outcome</th></tr></thead><tbody>'
                       + "".join(f"<tr><td>{_code(name)}</td><td>{_cell(c)}</td></tr>" for name, c in x.gates)
                       + "</tbody></table>")
    findings = ""
    if x.findings:
        more = f'<li class="muted small">… and {x.more_findings} more</li>' if x.more_findings else ""
        findings = ("<h4>Top findings</h4><ul class=\"findings\">" + "".join(_finding(f) for f in x.findings)
                    + more + "</ul>")
    error = f'<pre class="error">{e(x.error)}</pre>' if x.error else ""
    marks = (' <span class="badge b-solid">✓ accepted</span>' if x.accepted else "") + (
        ' <span class="badge b-green">best</span>' if x.best else "")
    parent = f'parent <a href="#exp-{e(x.parent)}">{e(x.parent)}</a>' if x.parent else "baseline"
    by = f" · {e(x.proposer)}" if x.proposer else ""
    cost = (f'<span class="cost">{e(x.wall)}{" · " + e(x.tier) if x.tier else ""} · {x.e2e_runs} e2e runs'
            f'{_launches(x.launches, " · ")} · '
            f"{x.probe_runs} probe runs · {x.llm_tokens:,} LLM tokens</span>")
    cls = "on-path" if x.on_path else "failed" if x.status in ("rejected", "error", "timeout") else "evidence"
    return (f'<article class="exp {cls}" id="exp-{e(x.id)}"><header>'
            f'<span class="eid">{e(x.id)}</span><span class="muted">#{x.seq} · {parent}{by}</span>'
            f"{badge(x.status)} {badge(x.verdict) if x.verdict else ''}{marks}{cost}</header>"
            f'<div class="statement">{e(x.statement)}</div>{error}'
            f'<div class="grid2"><div><h4>Hypothesis</h4>{_kv(hyp)}</div><div><h4>Probe</h4>{probe}</div>'
            f'<div><h4>Change</h4>{"".join(change)}</div><div><h4>Verdict</h4>{"".join(verdict)}</div></div>'
            f"{findings}</article>")


def _launches(n: int, sep: str) -> str:
    """``· 2 launches`` after the e2e runs; nothing when none were counted (a record from before)."""
    return f"{sep}{n} launch{'' if n == 1 else 'es'}" if n else ""


def _not_recorded(line: str) -> str:
    return f'<span class="muted">{e(line)}</span>' if line == NOT_RECORDED else e(line)


def _kv(items: list[tuple[str, str]]) -> str:
    return '<dl class="kv">' + "".join(f"<dt>{e(k)}</dt><dd>{v}</dd>" for k, v in items) + "</dl>"


def _header(m: ReportModel) -> str:
    facts = [("proposer", m.proposer), ("started", m.started), ("finished", m.finished), ("wall time", m.wall),
             ("experiments", str(m.n_experiments)), ("e2e runs", str(m.e2e_runs)),
             *([("server launches", str(m.launches))] if m.launches else []), ("LLM tokens", f"{m.llm_tokens:,}"),
             ("baseline", m.baseline or "–"), ("best", m.best or "–"), ("branch", m.branch or "–")]
    dl = "".join(f"<div><dt>{e(k)}</dt><dd>{e(v)}</dd></div>" for k, v in facts)
    msg = f'<div class="message">{e(m.message)}</div>' if m.message else ""
    if m.final_gates:
        # The final gate table's verdict sits beside the status, so "done" never reads as "fixed".
        msg = (f'<p class="final">{badge("pass" if m.final_gates_met else "fail")} final gates: '
               f"{e(m.final_gates)}</p>{msg}")
    nav = ('<nav class="toc"><a href="#gates">Gates</a><a href="#decisions">Decisions</a>'
           '<a href="#tree">Experiment tree</a><a href="#changes">Accepted changes</a>'
           '<a href="#experiments">Experiments</a><a href="#plot">Absolute metric</a></nav>')
    return (f'<header class="top"><h1>infra-agent report {badge(m.status)}</h1>'
            f'<p class="sub">run <code>{e(m.run_id)}</code> · workspace <code>{e(m.workspace)}</code></p>'
            f'<dl class="facts">{dl}</dl>{msg}{nav}</header>')


def render_model(m: ReportModel) -> str:
    body = [
        _header(m),
        f'<section id="gates"><h2>Gates: before → after</h2>{_gates(m)}</section>',
        _decisions(m),
        ('<section id="tree"><h2>Experiment tree</h2><p class="muted small">Green rows are the accepted path from '
         f"the baseline to the best; the others are evidence.</p>{_tree(m)}</section>"),
        _accepted(m),
        '<section id="experiments"><h2>Experiments</h2>' + "".join(_card(x) for x in m.experiments) + "</section>",
        _plot(m),
    ]
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>infra-agent report · {e(m.run_id)}</title><style>{CSS}</style></head>"
            f'<body><main>{"".join(body)}<footer>generated by infra-agent</footer></main></body></html>\n')


def render_html(run: RunRecord, experiments: list[Experiment]) -> str:
    return render_model(build_model(run, experiments))
