"""The ``thread_blocked`` finding, and the bursty stream it explains.

A thread that serves requests (an event loop, a tokenizer, an output thread: see
``thread_states.role_of``) that spends a share of the window parked off the GIL in a
call other than its normal wait holds up every request behind it, and no span shows it:
the thread is not running anything.  The share is read two ways: of the window, and of
the thread's own time (the window less its normal wait), since a loaded machine slows
the engine, the loop waits longer in its selector, and a fixed blocking call becomes a
smaller share of the window but not of the loop's own time.  The finding names the
thread, the kind of wait, the call site (function, file:line) and its share, and who
ran meanwhile.

A stream whose chunks arrive in bursts (the serving probe's ``bursty_stream``) has one
explanation the data can show first: the thread that writes the stream was parked, so
its chunks queued up and left together when it resumed.  :func:`explain_bursts` puts
that explanation ahead of Nagle's algorithm when such a finding is present.
"""

from __future__ import annotations

from infra_agent.feedback import Finding, Location
from infra_agent.trace.blocking_calls import OTHER
from infra_agent.trace.thread_states import (
    EVENT_LOOP,
    CallSite,
    ThreadStates,
    ThreadStatesReport,
)
from infra_agent.vocabulary import FindingKind

BLOCKED_SHARE_MIN = 0.2  # of the thread's sampled time, in calls other than its normal wait
# Or of the thread's own time (its normal wait left out), for a named blocking call (not
# "other"), with at least BLOCKED_FLOOR of the window: a loaded machine stretches the
# window around a fixed blocking call, and the thread's selector wait is what grows.
OWN_BLOCKED_MIN = 0.5
BLOCKED_FLOOR = 0.05
MIN_SAMPLES = 5  # fewer snapshots of a thread say too little about its shares
MIN_SITE_SAMPLES = 3  # the call site named must have been seen more than once or twice
HOLDER_SHARE_MIN = 0.5  # a lock's holder is named when seen inside its block in half the waits or more
# Roles whose thread writes (or hands over) the stream's chunks: parked, they hold chunks back.
STREAM_ROLES = (EVENT_LOOP, "output", "detokenizer", "http")


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _split_where(where: str) -> tuple[str | None, int | None]:
    file, _, line = where.rpartition(":")
    if file and line.isdigit():
        return file, int(line)
    return (where if where != "?" else None), None


def _question(t: ThreadStates, site: CallSite, kind: str) -> str:
    call = site.waits_in or site.function
    if t.role == EVENT_LOOP:
        return (f"Why does the event loop call {call} at {site.where}? A blocking call there stops every request the "
                "loop serves: await an async equivalent, or move it off the loop (loop.run_in_executor, "
                "asyncio.to_thread).")
    return {
        "lock": f"Who holds the lock {t.thread} waits for at {site.where}, and what does it do while holding it?",
        "queue": f"What fills the queue {t.thread} waits on at {site.where}, and why is it slow to?",
        "sleep": f"Why does {t.thread} sleep at {site.where}? A polling interval there adds to every request it serves.",
        "socket": f"What does {t.thread} wait for at {site.where}: a peer process, a reply, a slow client?",
        "subprocess": f"Why does {t.thread} wait for a subprocess at {site.where} while it serves requests?",
    }.get(kind, f"What native call is {t.thread} parked in at {site.where} ({call})?")


def thread_blocked(states: ThreadStatesReport | None) -> list[Finding]:
    """A serving thread parked off the GIL for more than ``BLOCKED_SHARE_MIN`` of the window."""
    out: list[Finding] = []
    for t in states.threads if states is not None else []:
        sites = t.blocked_sites()
        if t.role is None or t.samples < MIN_SAMPLES or not sites or sites[0].samples < MIN_SITE_SAMPLES:
            continue
        site = sites[0]
        kind = site.label.partition(":")[2]
        of_own = (t.own_blocked_share >= OWN_BLOCKED_MIN and t.blocked_share >= BLOCKED_FLOOR
                  and kind != OTHER)
        if t.blocked_share < BLOCKED_SHARE_MIN and not of_own:
            continue
        call = f" ({site.waits_in})" if site.waits_in else ""
        msg = (f"{t.role} thread {t.thread} was blocked off the GIL {_pct(t.blocked_share)} of the sampled window "
               f"({_pct(t.own_blocked_share)} of its own time, its normal wait left out; {t.samples} samples): "
               f"{_pct(site.share)} in {kind}{call} at {site.function} ({site.where})")
        m = site.meanwhile
        if m:
            msg += (f"; meanwhile {m['thread']} {m['how']} at {m['function']} ({m['where']}) in "
                    f"{_pct(float(m['share']))} of it")  # type: ignore[arg-type]
        else:
            msg += "; no other thread ran meanwhile"
        if t.role == EVENT_LOOP:
            msg += ": every request on this loop waits while it is parked"
        file, line = _split_where(site.where)
        loc = Location(file=file, line=line, function=site.function, thread=t.thread, span=site.span,
                       component="server")
        question = _question(t, site, kind)
        h = site.holder if site.holder and float(site.holder["share"]) >= HOLDER_SHARE_MIN else None  # type: ignore[arg-type]
        if h is not None:
            # The lock's holder is the cause: the location points at the section it holds the lock across.
            msg += (f"; the lock was held by {h['thread']} in {h['function']} ({h['where']}, inside `with {h['lock']}:` "
                    f"at line {h['with_line']}) in {_pct(float(h['share']))} of it")  # type: ignore[arg-type]
            hfile, hline = _split_where(str(h["where"]))
            loc = Location(file=hfile, line=hline, function=str(h["function"]), thread=str(h["thread"]),
                           component="server")
            question = (f"Why does {h['function']} ({h['where']}) hold {h['lock']} across that section while "
                        f"{t.thread} waits for it at {site.function} ({site.where})? Hold it only around the state it "
                        "guards, and do the long work outside it.")
        out.append(Finding(
            kind=FindingKind.THREAD_BLOCKED, severity="warning", message=msg, location=loc,
            evidence={"thread": t.thread, "role": t.role, "blocked_share": t.blocked_share,
                      "own_blocked_share": t.own_blocked_share, "kind": kind,
                      "waits_in": site.waits_in, "function": site.function, "where": site.where,
                      "site_share": site.share, "samples": t.samples, "site_samples": site.samples,
                      **({f"meanwhile_{k}": v for k, v in m.items()} if m else {}),
                      **({f"holder_{k}": v for k, v in h.items()} if h else {})},
            next_question=question))
    return out


def explain_bursts(findings: list[Finding]) -> None:
    """Put a parked stream-writing thread ahead of Nagle in every ``bursty_stream`` finding."""
    blocked = [f for f in findings if f.kind == FindingKind.THREAD_BLOCKED and f.evidence.get("role") in STREAM_ROLES]
    if not blocked:
        return
    top = max(blocked, key=lambda f: (f.evidence.get("role") == EVENT_LOOP, float(f.evidence["blocked_share"])))
    ev = top.evidence
    for f in findings:
        if f.kind != FindingKind.BURSTY_STREAM or "blocked_thread" in f.evidence:
            continue
        f.message += (f"; the {ev['role']} thread {ev['thread']} was blocked {_pct(float(ev['blocked_share']))} of "
                      f"the window in {ev['kind']} at {ev['function']} ({ev['where']}) (thread_blocked): chunks wait "
                      "while it is parked and leave together when it resumes")
        f.next_question = (f"Does {ev['thread']} block in {ev['waits_in'] or ev['function']} at {ev['where']}? Unblock it "
                           "first: a parked writer holds back every chunk. Only if bursts remain: "
                           + (f.next_question or ""))
        f.evidence.update({"blocked_thread": ev["thread"], "blocked_where": ev["where"], "blocked_kind": ev["kind"],
                           "blocked_share": ev["blocked_share"]})
