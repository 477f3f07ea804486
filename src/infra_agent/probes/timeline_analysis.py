"""The timeline probe's analysis: one traced window's spans and GIL samples, as findings.

Apart from the probe because it is the step after the measuring: it loads the spans (and
the py-spy samples, and the torch.profiler trace when there is one) into one timeline,
runs the analysis of :mod:`infra_agent.trace`, locates each finding in a component and,
where the workspace allows, a knob, and writes the merged Perfetto trace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from infra_agent.feedback import Artifact, Feedback, Finding, Measurement
from infra_agent.probes.base import ProbeContext
from infra_agent.probes.timeline_config import DEFAULT_SPAN_COMPONENTS, TimelineConfig
from infra_agent.probes.timeline_locate import knobs_for, locate, span_categories
from infra_agent.vocabulary import FindingKind


def analyse_window(cfg: TimelineConfig, ctx: ProbeContext, fb: Feedback, name: str, spans_path: Path | None,
                   sampler_res: Any, picked: dict[str, Any], result: dict[str, Any], arm: str | None,
                   kineto: Path | None = None, profile_notes: list[str] | None = None, stall_res: Any = None) -> None:
    """Add the findings, measurements and merged trace of one traced window to ``fb``.

    ``spans_path`` is the window's span trace (None: the target has none, and the py-spy
    samples are analysed alone), ``sampler_res`` the py-spy result (None: not sampled),
    ``picked`` the process it sampled, ``result`` the window's serving result, ``arm`` the
    compared knob's side, ``stall_res`` the ``py-spy record`` of that process for its event
    loops' stalls (None: not recorded).
    """
    from infra_agent.trace.analyze import analyze
    from infra_agent.trace.feedback import timeline_feedback
    from infra_agent.trace.load import TraceLoadError, load_timeline
    from infra_agent.trace.loop_stall_finding import rank_burst_explanations
    from infra_agent.trace.merge import write_merged
    from infra_agent.trace.thread_blocked import explain_bursts
    from infra_agent.trace.ttft_split import split_ttft_gap, ttft_split

    pyspy = sampler_res.path if sampler_res is not None else None
    notes = list(profile_notes or [])
    spans = [spans_path] if spans_path is not None else []
    try:
        try:
            tl = load_timeline(spans, pyspy=pyspy, kineto=[kineto] if kineto is not None else [])
        except TraceLoadError as exc:
            if kineto is None or str(kineto) not in str(exc):
                raise
            notes.append(f"torch.profiler trace left out: {exc}")  # it costs the Kineto part only
            tl = load_timeline(spans, pyspy=pyspy)
    except TraceLoadError as exc:
        fb.findings.append(Finding(kind=FindingKind.OVERLAP_UNMEASURABLE, severity="warning",
                                   message=f"the span trace could not be read: {exc}"))
        return
    if sampler_res is not None and sampler_res.warning:
        tl.warnings.append(sampler_res.warning)
    tl.warnings.extend(notes)
    if pyspy is not None:
        fb.artifacts.append(Artifact(kind="trace", path=str(pyspy), description="py-spy dump samples (JSON lines)"))
    expect = []
    for pair in cfg.expect_overlap:
        a, sep, b = pair.partition(":")
        if sep and a and b:
            expect.append((a, b))
    report = analyze(tl, by=cfg.by, expect_overlap=expect)
    hints = {**_workspace_hints(ctx.workspace, tl, cfg), **cfg.knob_hints}
    tfb = timeline_feedback(report, knob_hints=hints, serving_result=result if result.get("ok", True) else None,
                            meta={"sampled_process": picked})
    components = {**DEFAULT_SPAN_COMPONENTS, **cfg.span_components}
    cats = span_categories(tl)
    tags = {"scenario": name, **({"knob": arm} if arm else {})}
    for f in tfb.findings:
        locate(f, components, cats, ctx.workspace, hints)
        f.evidence.setdefault("scenario", name)
        fb.findings.append(f)
    # The serving windows' bursty_stream came first; a parked stream writer now explains it.
    explain_bursts(fb.findings)
    for m in tfb.measurements:
        m.tags.update(tags)
        fb.measurements.append(m)
    for w in report.waits[:8]:
        for thread, share in list(w.holder_threads.items())[:3]:
            fb.measurements.append(Measurement.from_samples("gil_holder_share", "ratio", [share], None, thread=thread,
                                                            interval=f"{w.group}@{w.thread}", **tags))
    loops = _loop_stalls(cfg, fb, stall_res, result, tags)
    split = ttft_split(tl.instants)
    split_ttft_gap(fb.findings, split)
    if split is not None:
        fb.meta.setdefault("timeline", {})["ttft_split"] = split
    rank_burst_explanations(fb.findings, loops, result if result.get("ok", True) else None, picked.get("tcp_nodelay"))
    merged = ctx.workdir / f"timeline-{name}.perfetto.json"
    try:
        write_merged(tl, merged)
        fb.artifacts.append(Artifact(kind="trace", path=str(merged),
                                     description="spans + GIL holder track on one clock (open in Perfetto)"))
    except (OSError, ValueError) as exc:
        tl.warnings.append(f"merged trace not written: {exc}")
    fb.meta.setdefault("timeline", {}).update({**tfb.meta, "report": _small_report(report)})


def _loop_stalls(cfg: TimelineConfig, fb: Feedback, stall_res: Any, result: dict[str, Any],
                 tags: dict[str, str]) -> list[Any]:
    """The event loops' stalls (trace/loop_stalls.py), lined up with the window's requests."""
    from infra_agent.trace.load import TraceLoadError
    from infra_agent.trace.loop_stall_finding import loop_stall_feedback
    from infra_agent.trace.loop_stalls import loop_stalls

    if stall_res is None:
        return []
    if stall_res.path is None:
        fb.meta.setdefault("timeline", {})["loop_stalls_error"] = stall_res.warning
        return []
    fb.artifacts.append(Artifact(kind="trace", path=str(stall_res.path),
                                 description=f"py-spy record at {cfg.stall_rate_hz} Hz, every thread (loop stalls)"))
    try:
        loops = loop_stalls(stall_res.path, stall_res.start_unix_ns, cfg.stall_rate_hz)
    except (TraceLoadError, ValueError, OSError) as exc:  # ValueError: a file py-spy cut short
        fb.meta.setdefault("timeline", {})["loop_stalls_error"] = f"{stall_res.path}: {exc}"
        return []
    findings, measurements, summary = loop_stall_feedback(loops, result if result.get("ok", True) else None, tags)
    for f in findings:
        f.evidence.setdefault("scenario", tags.get("scenario"))
    fb.findings.extend(findings)
    fb.measurements.extend(measurements)
    fb.meta.setdefault("timeline", {})["loop_stalls"] = summary
    return loops


def _workspace_hints(ws: Any, tl: Any, cfg: TimelineConfig) -> dict[str, str]:
    """Span name -> knob for span categories whose component exactly one workspace knob acts on."""
    if ws is None:
        return {}
    components = {**DEFAULT_SPAN_COMPONENTS, **cfg.span_components}
    out: dict[str, str] = {}
    for span_name, cat in span_categories(tl).items():
        comp = components.get(cat) or components.get(span_name.split(".", 1)[0])
        if comp is None:
            continue
        knobs = knobs_for(ws, comp)
        if len(knobs) == 1:
            out[span_name] = knobs[0]
    return out


def _small_report(report: Any) -> dict[str, Any]:
    d = report.to_dict()
    states = report.thread_states
    return {"duration_us": d["duration_us"], "samples": d["samples"], "warnings": d["warnings"],
            "threads": d["threads"][:8], "expected_overlap": d["expected_overlap"], "waits": d["waits"][:4],
            "holder_spans": d["holder_spans"], "sources": d["sources"],
            "thread_states": [{**t.to_dict(), "sites": [c.to_dict() for c in t.sites[:4]]} for t in states.threads[:12]]
            if states is not None else []}
