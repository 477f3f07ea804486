"""Where a timeline finding points: the component of the span it is about, and a knob when one fits.

The analysis names spans (``ep.dispatch|ep.combine`` held the GIL); the loop's
proposers act on components and knobs, so each finding is located here from the
span's category or name prefix and the workspace's knob table.
"""

from __future__ import annotations

from typing import Any

from infra_agent.feedback import Finding, Location
from infra_agent.vocabulary import FindingKind, related


def span_categories(tl: Any) -> dict[str, str]:
    out: dict[str, str] = {}
    for s in tl.span_sources():
        if s.name not in out and s.cat:
            out[s.name] = s.cat
    return out


def component_of(span: str | None, components: dict[str, str], cats: dict[str, str]) -> str | None:
    """The component of a span group (``ep.dispatch|ep.combine`` -> comm), from category or name prefix."""
    if not span:
        return None
    found = []
    for part in span.split("|"):
        cat = cats.get(part, part)
        comp = components.get(cat) or components.get(part.split(".", 1)[0])
        if comp:
            found.append(comp)
    return found[0] if found and len(set(found)) == 1 else None


def knobs_for(ws: Any, component: str, exact_only: bool = False) -> list[str]:
    """Workspace knobs whose components act on ``component`` (calibration knobs left out);
    those declared on exactly ``component`` alone when there are any (``gc_freeze`` on
    ``runtime.gc``, not every knob on ``runtime``), and only those with ``exact_only``."""
    out, exact = [], []
    for name, k in ws.knobs.items():
        if (k.help or "").lower().startswith("calibration") or name in ("trace",):
            continue
        if any(related(c, component) for c in k.components):
            out.append(name)
            if component in k.components:
                exact.append(name)
    return exact if exact or exact_only else out


def locate(f: Finding, components: dict[str, str], cats: dict[str, str], ws: Any, hints: dict[str, str]) -> None:
    """Give a timeline finding the component it is about, and a knob where exactly one fits.

    GIL contention and missing overlap are about the holder's span (``ep.dispatch`` held
    the GIL: the fix is in ``comm``), so the component comes from that span's category."""
    loc = f.location or Location()
    comp = component_of(loc.span, components, cats)
    if comp is not None and f.kind in (FindingKind.GIL_CONTENTION, FindingKind.NO_OVERLAP, FindingKind.SPAN_TREND,
                                       FindingKind.STEP_OVERHEAD, FindingKind.TRANSFER_WAIT):
        loc.component = comp
    # A knob only from a component the holder's span located (``runtime``, the default
    # of a GIL finding, is every thread-related knob and names none of them).
    if loc.knob is None and ws is not None and comp is not None and f.kind in (
            FindingKind.GIL_CONTENTION, FindingKind.NO_OVERLAP, FindingKind.TRANSFER_WAIT):
        knobs = knobs_for(ws, comp)
        if len(knobs) == 1:
            loc.knob = knobs[0]
    # A collector pause is located by the finding itself (``runtime.gc``), not by a span,
    # and only a knob declared on that component is about it (``torch_threads`` acts on
    # ``runtime`` too and does nothing to the collector).
    if loc.knob is None and ws is not None and f.kind == FindingKind.GC_PAUSE and loc.component:
        knobs = knobs_for(ws, loc.component, exact_only=True)
        if len(knobs) == 1:
            loc.knob = knobs[0]
    if loc.knob and f.next_question and loc.knob not in f.next_question:
        f.next_question += f" Try knob {loc.knob}."
    f.location = loc
