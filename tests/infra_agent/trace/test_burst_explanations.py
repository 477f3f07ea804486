"""``bursty_stream`` ranked by evidence: loop stalls first when the bursts line up with them, Nagle only
when the server's sockets are not known to have TCP_NODELAY set.

The results are written as the serving client writes them (``compute_metrics``), the
stalls as ``loop_stalls.stalls_of`` makes them.
"""

from __future__ import annotations

import time

from infra_agent.feedback import Finding
from infra_agent.serving.client import RequestRecord
from infra_agent.serving.metrics import compute_metrics
from infra_agent.trace.loop_stall_finding import (
    NAGLE_QUESTION,
    burst_holds,
    rank_burst_explanations,
)
from infra_agent.trace.loop_stalls import LoopStalls, Stall, StallSite
from infra_agent.vocabulary import FindingKind

SITE = StallSite("audit", "/srv/app.py:42", "sleep", "time.sleep")


def _bursty_result() -> dict[str, object]:
    """10 requests 1 s apart; each waits 100 ms after its first token, then 3 chunks arrive together,
    then 4 gaps of 10 ms."""
    t0 = time.perf_counter()
    recs = []
    for i in range(10):
        r = RequestRecord(prompt_len=8, output_len=9, success=True)
        r.start, r.ttft = t0 + i, 0.05
        r.itl = [0.1, 0.0001, 0.0001, 0.01, 0.01, 0.01, 0.01, 0.01]
        r.latency = r.ttft + sum(r.itl)
        recs.append(r)
    return compute_metrics(recs, duration=10.0)


def _loop(res: dict[str, object], at: list[tuple[float, float]]) -> LoopStalls:
    z = res["start_times"][0]  # type: ignore[index]
    ls = LoopStalls("MainThread", int(z * 1e9), (0.0, 12e6), 5.0)
    for a, b in at:
        ls.stalls.append(Stall(a * 1e6, b * 1e6, SITE))
        ls.segments.append((a * 1e6, b * 1e6, SITE))
        ls.site_us[SITE] = ls.site_us.get(SITE, 0.0) + (b - a) * 1e6
    return ls


def _finding() -> Finding:
    return Finding(kind=FindingKind.BURSTY_STREAM, severity="warning", message="chunks are held back",
                   next_question=NAGLE_QUESTION)


def test_bursts_that_follow_loop_stalls_say_so_first() -> None:
    res = _bursty_result()
    # The loop stalls 80 ms inside each request's 100 ms wait before its burst.
    ls = _loop(res, [(i + 0.06, i + 0.14) for i in range(10)])
    h = burst_holds(res, ls.intervals_unix_s())
    assert h is not None and h["holds"] == 10 and abs(h["hold_stalled_share"] - 0.8) < 1e-3
    assert h["rest_stalled_share"] == 0.0
    f = _finding()
    rank_burst_explanations([f], [ls], res, None)
    assert "line up with event-loop stalls" in f.message and "80%" in f.message and "audit" in f.message
    q = f.next_question or ""
    # The stall first; Nagle stays (the socket option is unknown), after it.
    assert q.index("Unstall the event loop") < q.index("Nagle") and f.evidence["holds"] == 10


def test_nagle_is_not_offered_when_the_servers_sockets_set_nodelay() -> None:
    res = _bursty_result()
    f = _finding()
    rank_burst_explanations([f], [], res, {"connections": 4, "nodelay": 4})
    assert "Nagle" not in (f.next_question or "") and "stream interval" in (f.next_question or "")
    assert "TCP_NODELAY is set on 4 of the 4" in f.message and "not the cause" in f.message
    # Unset on some: Nagle stays a question.
    g = _finding()
    rank_burst_explanations([g], [], res, {"connections": 4, "nodelay": 1})
    assert g.next_question == NAGLE_QUESTION and "on for some" in g.message


def test_stalls_elsewhere_do_not_explain_the_bursts() -> None:
    res = _bursty_result()
    ls = _loop(res, [(i + 0.5, i + 0.6) for i in range(10)])  # between requests, in no wait
    f = _finding()
    rank_burst_explanations([f], [ls], res, None)
    assert "line up" not in f.message and f.next_question == NAGLE_QUESTION
