"""Timeline analysis: traces on one clock, interval analysis, trends, diffs, findings.

    from infra_agent.trace import analyze_timeline, load_timeline, timeline_feedback

    tl = load_timeline(["spans.json"], pyspy="pyspy.json", pyspy_start_unix_ns=start)
    report = analyze_timeline(tl, expect_overlap=[("transfer", "ep.dispatch|ep.combine")])
    fb = timeline_feedback(report, knob_hints={"moe.py": "ep_release_gil"}, serving_result=result)

Modules, one concept each: ``model`` (the data), ``clock`` (alignment), ``load`` and
``pyspy`` (formats), ``intervals``, ``overlap``, ``gil``, ``critical``, ``trends``,
``diff``, ``merge`` (Perfetto output), ``sampler`` (running py-spy), ``analyze`` (all
analyses as one report) and ``feedback`` (findings).  See docs/timeline.md.

The functions exported here are named apart from the modules (``analyze_timeline``,
not ``analyze``): a submodule, once imported, shadows a package attribute of its name.
"""

from __future__ import annotations

from typing import Any

__all__ = ["TraceLoadError", "analyze_timeline", "diff_timelines", "load_timeline", "timeline_feedback", "write_merged"]


def __getattr__(name: str) -> Any:
    # lazy: the CLI imports this package for its error type without pulling numpy/scipy
    if name == "load_timeline" or name == "TraceLoadError":
        from infra_agent.trace import load

        return getattr(load, name)
    if name == "analyze_timeline":
        from infra_agent.trace.analyze import analyze

        return analyze
    if name == "timeline_feedback":
        from infra_agent.trace.feedback import timeline_feedback

        return timeline_feedback
    if name == "diff_timelines":
        from infra_agent.trace.diff import diff

        return diff
    if name == "write_merged":
        from infra_agent.trace.merge import write_merged

        return write_merged
    raise AttributeError(name)
