"""Which code ran: a sampled stack's own frame, the code that grew, the code behind a step's phase.

A py-spy stack often ends in frames no change would edit: the standard library's
(``JSONEncoder.iterencode`` under a ``json.dumps``) and a comprehension's or generator
expression's frame of its own (``<genexpr>``, ``<setcomp>``: Python 3.11 runs every one
as a frame, 3.12 inlines list, set and dict comprehensions).  The **code site** of a
stack is the innermost frame that is neither: the function that called into the library
or holds the comprehension, the one whose code would change.  Third-party packages
count as code: for a server we did not write (vLLM), its own package is the code.

Each dump snapshot of a thread weighs the time up to the midpoints with its neighbours
(as in the thread-state analysis).  A dump's time is known only to the tens of
milliseconds a ``py-spy dump`` takes, far coarser than an engine step, so no snapshot is
placed inside one span: the code behind a span is found from the stacks alone, over
seconds.  ``growth_site`` names the code whose share of a thread rose across the
window (the code behind a span that grows); ``phase_site`` the callee of a loop's step
function behind one phase of the step (the code behind a step's non-model time).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from infra_agent.trace.blocking_calls import blocking_call
from infra_agent.trace.model import Frame, Sample, Timeline, snapshot_weights

# The standard library's files (not its site-packages), and the import system's frozen modules.
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(?:\.\d+)?t?[/\\](?!(?:site|dist)-packages[/\\])|^<frozen ", re.I)
# A comprehension's or lambda's frame: its time is its function's.
_COMPREHENSIONS = frozenset({"<genexpr>", "<listcomp>", "<setcomp>", "<dictcomp>", "<lambda>"})


def is_plumbing(frame: Frame) -> bool:
    """A frame no change would edit: the standard library's, or a comprehension's own."""
    return bool(_STDLIB.search(frame.file)) or frame.name.rsplit(".", 1)[-1] in _COMPREHENSIONS


def code_frame(frames: Sequence[Frame]) -> Frame | None:
    """The innermost frame (frames innermost last) that is the program's own code; the
    innermost frame when every one is plumbing (a thread running only the library)."""
    for f in reversed(frames):
        if not is_plumbing(f):
            return f
    return frames[-1] if frames else None


@dataclass
class CodeSite:
    function: str
    where: str  # file:line of the code frame (its line seen most)
    us: float  # sampled time of the snapshots whose stack holds it
    share: float  # of the sampled time it is a site of
    samples: int
    before: float | None = None  # a growing site's share in the first third, ``share`` being the last's

    def to_dict(self) -> dict[str, object]:
        return {"function": self.function, "where": self.where, "us": self.us, "share": self.share,
                "samples": self.samples, "before": self.before}


@dataclass
class _Seen:
    us: float = 0.0
    n: int = 0
    depth: int = 0
    lines: dict[str, float] = field(default_factory=lambda: defaultdict(float))


class _Profile:
    """Inclusive sampled time per code frame (function, file) of some dump snapshots, and its lines."""

    def __init__(self) -> None:
        self.total = 0.0
        self.n = 0
        self.seen: dict[tuple[str, str], _Seen] = defaultdict(_Seen)

    def add(self, frames: Sequence[Frame], w: float) -> None:
        self.total += w
        self.n += 1
        counted: set[tuple[str, str]] = set()
        code = [f for f in frames if not is_plumbing(f)] or list(frames[-1:])  # () adds only to the total
        for depth, f in enumerate(code):
            key = (f.name, f.file)
            if key in counted:
                continue  # recursion: a stack counts once per function
            counted.add(key)
            acc = self.seen[key]
            acc.us, acc.n, acc.depth = acc.us + w, acc.n + 1, max(acc.depth, depth)
            acc.lines[f.where()] += w

    def share(self, key: tuple[str, str]) -> float:
        acc = self.seen.get(key)
        return acc.us / self.total if acc is not None and self.total > 0 else 0.0

    def site(self, key: tuple[str, str]) -> CodeSite:
        a = self.seen[key]
        return CodeSite(key[0], max(a.lines, key=a.lines.__getitem__), a.us, self.share(key), a.n)


def _snapshots(timeline: Timeline, threads: set[str]) -> list[tuple[float, Sample, float]]:
    """(ts, sample, weight) of the dump snapshots of ``threads`` (weights over every snapshot's time)."""
    if timeline.sampled_window is None:
        return []
    snaps = [s for s in timeline.samples if s.snapshot]
    times = sorted({s.ts_us for s in snaps})
    weight = dict(zip(times, snapshot_weights(times, timeline.sampled_window), strict=True))
    return [(s.ts_us, s, weight[s.ts_us]) for s in snaps if s.thread in threads and s.frames]


def _word(name: str) -> str:
    """What a function or span is called, for matching the two: ``Engine._sample`` -> ``sample``,
    ``model.forward`` -> ``forward``."""
    return name.rsplit(".", 1)[-1].lstrip("_").lower()


class _Phases:
    """The step function of a loop thread and the phase each stack is in.

    The step function is the deepest code frame on nearly every snapshot not at rest that
    calls the model (``Engine.step``; a callee that takes nearly all the time, as a slow
    journal write can, is on as many snapshots but calls no model); each of its callees is
    matched to the step's spans by name: a callee called like a model span (``_forward``:
    ``model.forward``) is the model, one called like a phase (``_sample``: ``sample``) is
    that phase, any other is code no span covers (``untraced``)."""

    def __init__(self, busy: list[tuple[Sample, float]], model_spans: Sequence[str], phases: Sequence[str]) -> None:
        whole = _Profile()
        for s, w in busy:
            whole.add(s.frames, w)
        self.model = {_word(n) for n in model_spans}
        self.named = self.model | {_word(n) for n in phases}
        common = sorted((k for k, a in whole.seen.items() if a.us >= 0.9 * whole.total),
                        key=lambda k: -whole.seen[k].depth)
        self.step = next((k for k in common if self._calls_model(k, busy)), common[0] if common else None)

    def _calls_model(self, key: tuple[str, str], busy: list[tuple[Sample, float]]) -> bool:
        for s, _ in busy:
            code = [f for f in s.frames if not is_plumbing(f)]
            at = next((i for i, f in enumerate(code) if (f.name, f.file) == key), None)
            if at is not None and at + 1 < len(code) and _word(code[at + 1].name) in self.model:
                return True
        return False

    def callee(self, frames: Sequence[Frame]) -> list[Frame]:
        """The stack's code frames from the step function's callee inwards ([] outside the step)."""
        code = [f for f in frames if not is_plumbing(f)]
        at = next((i for i, f in enumerate(code) if (f.name, f.file) == self.step), None)
        return code[at + 1:] if at is not None else []

    def matches(self, callee: Frame, phase: str) -> bool:
        """``callee`` runs ``phase``: a model span (any model callee), a named phase, or ``untraced``."""
        word = _word(callee.name)
        if phase == "untraced":
            return word not in self.named
        return word in self.model if _word(phase) in self.model else word == _word(phase)


def _working(s: Sample) -> bool:
    """Running the program's code: holding the GIL, or on a CPU in a native call of its own (a
    kernel).  Not a thread in the standard library's I/O (a socket call that released the GIL,
    then waits to take it back from a thread that works more): that is another thread's work."""
    return s.holds_gil or (not s.idle and s.leaf is not None and not is_plumbing(s.leaf))


def _busy(timeline: Timeline, threads: set[str]) -> list[tuple[float, Sample, float]]:
    return [r for r in _snapshots(timeline, threads) if not _at_rest(r[1].frames)]


def growth_site(timeline: Timeline, threads: set[str], phase: str | None = None, model_spans: Sequence[str] = (),
                phases: Sequence[str] = (), min_rise: float = 0.1, min_samples: int = 4) -> CodeSite | None:
    """The code site (see ``code_frame``) whose share of ``threads``' working sampled time rose
    most from its first third to its last, within one ``phase`` of the thread's steps when
    given (see ``_Phases``): the function whose own time grew, with the library and the
    comprehensions it calls counted as its own.  Not a caller: a caller's inclusive time rises
    with every callee's, so only the innermost code says which one grew (and a dump of a running
    thread now and then misses its innermost frames, which makes a caller look like the leaf
    only now and then).  None when no share rose by ``min_rise``, or with fewer than
    ``min_samples`` snapshots in a third."""
    rows = [r for r in _snapshots(timeline, threads) if _working(r[1])]
    if not rows:
        return None
    steps = _Phases([(s, w) for _, s, w in _busy(timeline, threads)], model_spans, phases) if phase else None
    # The first and last thirds of the working time (not of the window): work that grows with
    # each token grows fastest at the end, and the middle third dilutes both sides.
    times = sorted(ts for ts, _, _ in rows)
    first, last = times[len(times) // 3], times[(2 * len(times)) // 3]
    early, late = _Profile(), _Profile()
    for ts, s, w in rows:
        if first <= ts < last:
            continue
        site = code_frame(s.frames)
        if steps is not None and phase is not None:
            inner = steps.callee(s.frames)
            site = site if inner and steps.matches(inner[0], phase) else None
        (early if ts < first else late).add([site] if site is not None else [], w)
    if min(early.n, late.n) < min_samples:
        return None
    rise = {k: late.share(k) - early.share(k) for k in late.seen}
    key = max(rise, key=rise.__getitem__, default=None)
    if key is None or rise[key] < min_rise:
        return None
    site = late.site(key)
    site.before = early.share(key)
    return site


def phase_site(timeline: Timeline, threads: set[str], phase: str, model_spans: Sequence[str],
               phases: Sequence[str], min_share: float = 0.1, min_samples: int = 2) -> CodeSite | None:
    """The code behind one phase of a loop's steps (see ``_Phases``), from the working stacks
    of ``threads`` (see ``_working``): the largest callee of ``phase``, if it holds
    ``min_share`` of that time, named by its deepest frame on most of its snapshots.  None
    when no callee matches."""
    busy = [(s, w) for _, s, w in _busy(timeline, threads)]
    steps = _Phases(busy, model_spans, phases)
    working = [(s, w) for s, w in busy if _working(s)]
    if len(working) < min_samples or steps.step is None:
        return None
    total = sum(w for _, w in working)
    callees: dict[tuple[str, str], _Profile] = defaultdict(_Profile)
    for s, w in working:
        inner = steps.callee(s.frames)
        if inner and steps.matches(inner[0], phase):
            callees[(inner[0].name, inner[0].file)].add(inner, w)
    if not callees:
        return None
    prof = callees[max(callees, key=lambda k: callees[k].total)]
    if prof.total < min_share * total or prof.n < min_samples:
        return None
    key = max((k for k, a in prof.seen.items() if a.us >= 0.5 * prof.total), key=lambda k: prof.seen[k].depth)
    site = prof.site(key)
    site.share = prof.seen[key].us / total
    return site


def _at_rest(frames: Sequence[Frame]) -> bool:
    """A worker waiting for work at its outer loop (the engine loop's ``self._wake.wait()``)."""
    b = blocking_call(frames)
    return b is not None and b.for_work and b.outer
