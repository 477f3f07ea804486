"""The Markdown summary: readable as plain text in a terminal, and rendered on a forge.

Text from experiments is made inert: a ``<`` that could open an HTML tag becomes
``&lt;``, table cells have their pipes escaped, and code goes into backtick spans or
fences longer than any backtick run inside it.
"""

from __future__ import annotations

import math
import re

from infra_agent.records import Experiment, RunRecord
from infra_agent.report.decisions import GLYPHS, OUTCOME_LABELS, Decision
from infra_agent.report.fmt import fmt_interval, fmt_num
from infra_agent.report.model import ExperimentView, GateCell, ReportModel, build_model
from infra_agent.report.ratio_plot import half_range

_TAG_START = re.compile(r"<(?=[A-Za-z/!?])")
_MARK = {"pass": "✓", "supported": "✓", "fail": "✗", "refuted": "✗", "error": "✗", "inconclusive": "?",
         "skipped": "–", "done": "✓", "rejected": "✗", "timeout": "✗", "interrupted": "!", "running": "…"}


def text(s: str) -> str:
    """Prose: one line, no HTML tags."""
    return _TAG_START.sub("&lt;", " ".join(s.split()))


def cell(s: str) -> str:
    return text(s).replace("|", "\\|")


def code(s: str) -> str:
    """An inline code span that survives any backticks inside."""
    s = " ".join(s.split())
    if not s:
        return "–"
    ticks = "`" * (max((len(r) for r in re.findall(r"`+", s)), default=0) + 1)
    pad = " " if s.startswith("`") or s.endswith("`") else ""
    return f"{ticks}{pad}{s}{pad}{ticks}"


def fence(body: str, lang: str = "") -> str:
    ticks = "`" * max(3, max((len(r) for r in re.findall(r"`+", body)), default=0) + 1)
    return f"{ticks}{lang}\n{body.rstrip(chr(10))}\n{ticks}"


def outcome(word: str) -> str:
    return f"{_MARK.get(word, '·')} {word}" if word else "–"


def _knobs(knobs: list[tuple[str, str]]) -> str:
    return ", ".join(code(f"{k}={v}") for k, v in knobs)


def _gate_cell(c: GateCell | None) -> str:
    if c is None:
        return "not evaluated"
    out = f"{outcome(c.outcome)} {c.value}"
    if c.interval:
        out += f" {c.interval}"
    if c.measured_in:
        out += f" (in {c.measured_in})"
    return cell(out)


def _header(m: ReportModel) -> list[str]:
    lines = [f"# infra-agent report: run {code(m.run_id)}", "",
             f"- **Status:** {outcome(m.status)}" + (f" · **Final gates:** {text(m.final_gates)}" if m.final_gates else ""),
             f"- **Workspace:** {code(m.workspace)}",
             f"- **Proposer:** {text(m.proposer)}",
             f"- **Started / finished:** {m.started} / {m.finished} (wall time {m.wall})",
             f"- **Experiments:** {m.n_experiments} · **e2e runs:** {m.e2e_runs}"
             + (f" · **Server launches:** {m.launches}" if m.launches else "") + f" · **LLM tokens:** {m.llm_tokens:,}",
             f"- **Baseline:** {code(m.baseline)} · **Best:** {code(m.best)} · **Branch:** {code(m.branch)}"]
    if m.message:
        lines += ["", f"> {text(m.message)}"]
    return lines


def _gates(m: ReportModel) -> list[str]:
    lines = ["", "## Gates: before → after", ""]
    if not m.gates:
        return [*lines, "No gates were evaluated."]
    lines += ["| Gate | Condition | Before | After | Interval |", "|---|---|---|---|---|"]
    for g in m.gates:
        labels = [c.label for c in (g.before, g.after) if c is not None and c.label]
        label = labels[0] if len(set(labels)) == 1 else "; ".join(
            f"{side}: {c.label}" for side, c in (("before", g.before), ("after", g.after)) if c is not None and c.label)
        lines.append(f"| {cell(g.name)} | {code(g.gate).replace('|', chr(92) + '|')} | {_gate_cell(g.before)} | "
                     f"{_gate_cell(g.after)} | {cell(label) or '–'} |")
    return lines


_STRIP = 41  # characters in a ratio strip; the middle one is 1.0


def _strip(d: Decision, m: float) -> str:
    """The decision on a log axis in text: ``│`` 1.0, ``┆`` the line it needed, ``─`` the interval, the marker."""
    if d.effect is None:
        return ""

    def at(r: float) -> int:
        v = max(-m, min(m, math.log(r)))
        return round((v / m + 1) / 2 * (_STRIP - 1))

    row = ["·"] * _STRIP
    if d.low is not None and d.high is not None:
        for i in range(at(d.low), at(d.high) + 1):
            row[i] = "─"
    row[at(1.0)] = "│"
    if d.threshold is not None:
        row[at(d.threshold)] = "┆"
    row[at(d.effect)] = GLYPHS[d.outcome]
    return "".join(row)


def _decisions(m: ReportModel) -> list[str]:
    d = m.decisions
    lines = ["", "## Decisions: each experiment's ratio against its parent", ""]
    if not d.items:
        return [*lines, text(d.note or "Nothing to plot.")]
    lines += [("What each verdict was decided on: the ratio candidate / parent of the hypothesis metric, from windows "
               "measured interleaved (A B A B), with its interval, against the line the hypothesis needed. The "
               "confirmation (★) is the best against the baseline; a count is decided exactly, not as a ratio. "
               "In the strip (log scale, left lower, right higher): │ is 1.0, ┆ the line, ─ the interval."), ""]
    half = half_range(d.ratios)
    lines += ["| Seq | Experiment | Metric | Outcome | Effect | Interval | Needs | Strip | Load |",
              "|---:|---|---|---|---:|---|---|---|---|"]
    for x in d.items:
        effect = {"ratio": f"{fmt_num(x.effect)}×", "count": x.count_text()}.get(x.kind, "–")
        interval = (fmt_interval(x.low, x.high) or "–") if x.kind == "ratio" else "–"
        strip = f"`{_strip(x, half)}`" if x.kind == "ratio" else cell(x.why) if x.kind == "none" else ""
        outcome = f"{GLYPHS[x.outcome]} {OUTCOME_LABELS[x.outcome]}"
        lines.append(f"| {x.seq} | {cell(x.label)} | {code(x.metric)} | {outcome} | {effect} | {interval} | "
                     f"{cell(x.need) or '–'} | {strip} | {cell(x.load) or 'not recorded'} |")
    return lines


def _plot(m: ReportModel) -> list[str]:
    s = m.series
    lines = ["", f"## Best {text(s.metric) or 'metric'} over experiments (absolute, context)", ""]
    if not s.points:
        return [*lines, text(s.note or "Nothing to plot.")]
    unit = f" [{s.unit}]" if s.unit else ""
    scen = f" in scenario {code(s.scenario)}" if s.scenario else ""
    lines += [(f"The candidate's median {code(s.metric)}{scen} per experiment ({s.direction} is better); "
              f"chosen as {text(s.source)}. Context for the absolute criterion only: these medians come from windows "
              "measured at different times, so a higher row is not a decision (see Decisions)."), ""]
    if s.target is not None:
        lines += [f"{text(s.target_label).capitalize()}{' ' + s.unit if s.unit else ''}.", ""]
    lo, hi = min(p.value for p in s.points), max(p.value for p in s.points)
    lines += [f"| Seq | Experiment | {cell(s.metric + unit)} | Best so far | |", "|---:|---|---:|---:|---|"]
    best: float | None = None
    for p in sorted(s.points, key=lambda p: p.seq):
        if p.accepted:
            best = p.value
        bar = "█" * (1 + round(19 * (p.value - lo) / (hi - lo))) if hi > lo else "█" * 10
        mark = " ★" if p.accepted else ""
        lines.append(f"| {p.seq} | {cell(p.id)}{mark} | {fmt_num(p.value)} | {fmt_num(best)} | `{bar}` |")
    return [*lines, "", "★ baseline or accepted (on the best-so-far line)"]


def _tree_line(x: ExperimentView) -> str:
    marks = " · ".join(w for w, on in (("baseline", x.baseline), ("**✓ ACCEPTED**", x.accepted), ("best", x.best)) if on)
    verdict = outcome(x.verdict) if x.verdict else "no verdict"
    if x.verdict and x.effect not in ("", "–"):
        verdict += f" {x.effect} {x.effect_interval}".rstrip()
    change = " + ".join(p for p in (_knobs(x.knobs), "diff" if x.diff else "") if p) or "no change"
    probe = f"{code(x.probe)} ({x.probe_tier})" if x.probe else "no probe"
    on = f" — on {text(x.node)}" if x.node else ""
    return (f"{'  ' * x.depth}- **{text(x.id)}** #{x.seq}{' · ' + marks if marks else ''} — {outcome(x.status)} — "
            f"{verdict} — {text(x.statement)} — {change} — {probe}{on}")


def _probe(x: ExperimentView) -> str:
    if not x.probe:
        return "not run"
    out = f"{code(x.probe)} ({x.probe_tier})"
    if x.probe_reason:
        out += f" — {text(x.probe_reason)}"
    return out + (f"; config {code(x.probe_config)}" if x.probe_config else "")


def _experiment(x: ExperimentView) -> list[str]:
    flag = " · ✓ accepted" if x.accepted else ""
    parent = f"parent {code(x.parent)}" if x.parent else "baseline"
    loc = code(x.locality) if x.locality not in ("", "-") else "–"
    as_gate = "" if x.baseline else f"; as a gate {code(x.hypothesis_gate)}"
    diff_note = "; diff in Accepted changes" if x.diff and x.accepted else "; diff below" if x.diff else ""
    lines = ["", f"### {text(x.id)} (#{x.seq}, {parent}){flag}", "", f"> {text(x.statement)}", "",
             (f"- **Hypothesis:** {code(x.metric)} {x.direction}, min effect {x.min_effect}; "
              f"scenario {code(x.scenario)}; locality {loc}{as_gate}"),
             (f"- **Change:** {text(x.description) + '; ' if x.description else ''}"
              f"{_knobs(x.knobs) or 'no knobs'}{diff_note}"),
             f"- **Probe:** {_probe(x)}",
             f"- **Status:** {outcome(x.status)}"]
    if x.verdict:
        label = f" ({text(x.effect_label)})" if x.effect_label else ""
        effect = " ".join(p for p in (x.effect, x.effect_interval) if p)
        lines.append(f"- **Verdict:** {outcome(x.verdict)}, effect {effect}{label}"
                     f"{', accepted' if x.accepted else ', not accepted'}"
                     + (f" — {text(x.verdict_message)}" if x.verdict_message else ""))
        for name, c in x.gates:
            lines.append(f"  - {code(name)}: {_gate_cell(c).replace(chr(92) + '|', '|')}")
    if x.noise.measured:
        n = x.noise
        lines.append(f"- **Noise:** interval width {text(n.interval)}; foreign CPU {text(n.foreign_cpu)}; "
                     f"load (1 min) {text(n.load)}")
    launches = f"{x.launches} launch{'' if x.launches == 1 else 'es'}, " if x.launches else ""
    lines.append(f"- **Cost:** {x.wall}, tier {x.tier or '–'}, {x.e2e_runs} e2e runs, {launches}{x.probe_runs} probe runs, "
                 f"{x.llm_tokens:,} LLM tokens")
    if x.findings:
        lines.append("- **Top findings:**")
        for f in x.findings:
            at = f" @ {code(f.location)}" if f.location else ""
            lines.append(f"  - [{f.severity}] {code(f.kind)} {text(f.message)}{at}")
            if f.next_question:
                lines.append(f"    next: {text(f.next_question)}")
        if x.more_findings:
            lines.append(f"  - … and {x.more_findings} more")
    if x.error:
        lines += ["", "Error:", "", fence(x.error)]
    if x.diff and not x.accepted:
        lines += ["", "<details><summary>diff</summary>", "", fence(x.diff, "diff"), "", "</details>"]
    return lines


def render_model(m: ReportModel) -> str:
    lines = _header(m) + _gates(m) + _decisions(m)
    lines += ["", "## Experiment tree", "", *(_tree_line(x) for x in m.experiments)]
    lines += ["", "## Accepted changes"]
    if not m.accepted:
        lines += ["", "No change was accepted: the baseline is still the best."]
    for x in m.accepted:
        lines += ["", f"### {text(x.id)} (#{x.seq}): {text(x.description or x.statement)}", ""]
        if x.knobs:
            lines += [f"Knobs: {_knobs(x.knobs)}", ""]
        lines.append(fence(x.diff, "diff") if x.diff else "No code change (knobs only).")
    if m.best_knobs:
        lines += ["", f"Best configuration ({code(m.best)}): {_knobs(m.best_knobs)}"]
    lines += ["", "## Experiments"]
    for x in m.experiments:
        lines += _experiment(x)
    lines += _plot(m)
    return "\n".join(lines) + "\n"


def render_markdown(run: RunRecord, experiments: list[Experiment]) -> str:
    return render_model(build_model(run, experiments))
