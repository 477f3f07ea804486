"""The timeline probe's thread states: wired into its findings, and from py-spy alone on a
server whose spans it cannot fetch (as on a server we did not write)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from infra_agent.feedback import Feedback, Finding, Location, Tier
from infra_agent.probes.base import ProbeContext
from infra_agent.probes.timeline import TimelineProbe
from infra_agent.probes.timeline_analysis import analyse_window
from infra_agent.probes.timeline_config import TimelineConfig
from infra_agent.trace.sampler import PySpyResult
from infra_agent.trace.thread_blocked import MIN_SAMPLES
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace import load_workspace

from ..trace.synth_dumps import SLEEP_LINE, app_file, asyncio_server, write_dumps


def _bursty() -> Finding:
    return Finding(kind=FindingKind.BURSTY_STREAM, severity="warning", message="70% of inter-token gaps are short",
                   location=Location(component="server"), evidence={"short_share": 0.7},
                   next_question="Is Nagle's algorithm on for the server's connections (TCP_NODELAY unset)?")


def test_a_window_without_spans_gets_thread_states_and_the_blocked_loop_explains_the_bursts(tmp_path: Path) -> None:
    app = app_file(tmp_path)
    dumps = write_dumps(tmp_path / "gil.jsonl", asyncio_server(app, blocking=True))
    fb = Feedback(probe="timeline", tier=Tier.trace, findings=[_bursty()])
    ctx = ProbeContext(workdir=tmp_path / "out", progress=False)
    ctx.workdir.mkdir()
    analyse_window(TimelineConfig(), ctx, fb, "chat", None, PySpyResult(dumps, None), {"pid": 1}, {"ok": False}, None)
    blocked = [f for f in fb.findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert len(blocked) == 1 and blocked[0].location is not None
    assert (blocked[0].location.file, blocked[0].location.line, blocked[0].location.component) == (app, SLEEP_LINE, "server")
    assert blocked[0].evidence["scenario"] == "chat"
    bursty = next(f for f in fb.findings if f.kind == FindingKind.BURSTY_STREAM)
    q = bursty.next_question or ""
    assert "MainThread" in q and q.index("MainThread") < q.index("Nagle")
    share = [m for m in fb.measurements if m.name == "thread_blocked_share"]
    assert share and share[0].tags["thread"] == "MainThread" and share[0].tags["scenario"] == "chat"
    states = fb.meta["timeline"]["report"]["thread_states"]
    assert states[0]["thread"] == "MainThread" and states[0]["role"] == "event loop"
    assert TimelineProbe.measures("thread_blocked_share")


PLAIN_YAML = """
target:
  kind: server
  command: refstack serve --preset tiny --port {port}
  ready_url: /health
  ready_timeout_s: 120
  model: refstack-tiny
scenarios:
  s:
    dataset: {kind: random, input_len: 32, output_len: 32, seed: 0}
    num_requests: 48
    max_concurrency: 3
    request_rate: inf
"""


def _pyspy_works() -> bool:
    try:
        return subprocess.run(["py-spy", "--version"], capture_output=True, timeout=20, check=False).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _pyspy_works(), reason="py-spy is not installed")
def test_a_server_without_spans_is_analysed_from_py_spy_alone(tmp_path: Path) -> None:
    """refstack with tracing off and a trace path it does not serve: no spans, as with vLLM;
    the sampled threads' states still come back, its uvicorn loop among them."""
    root = tmp_path / "plain"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(PLAIN_YAML)
    fb = TimelineProbe().execute({"lead_s": 0, "sample_process": "server", "trace_path": "/no-such-trace"},
                                 ProbeContext(workdir=tmp_path / "out", workspace=load_workspace(root), progress=False))
    assert fb.ok, fb.error
    if any(f.kind == FindingKind.SAMPLER_UNAVAILABLE for f in fb.findings):
        pytest.skip("py-spy could not attach here")
    assert any(f.kind == FindingKind.OVERLAP_UNMEASURABLE and "no span trace" in f.message for f in fb.findings)
    states = fb.meta["timeline"]["report"]["thread_states"]
    loops = [t for t in states if t["role"] == "event loop"]
    assert loops and loops[0]["samples"] >= MIN_SAMPLES, states
    # refstack's loop rests in its selector between requests: not a blocked loop
    assert loops[0]["shares"].get("idle", 0.0) > 0 and not [f for f in fb.findings if f.kind == FindingKind.THREAD_BLOCKED]
    assert {"thread_blocked_share", "output_throughput"} <= {m.name for m in fb.measurements}
    assert any(a.path.endswith(".jsonl") for a in fb.artifacts)


@pytest.mark.slow
def test_a_window_shorter_than_the_lead_in_says_why_it_has_no_thread_states(tmp_path: Path) -> None:
    """No spans and no samples (the load ended inside ``lead_s``, before py-spy started): the probe
    used to return with neither thread states nor a reason; it says which of them it lacks."""
    root = tmp_path / "plain"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(PLAIN_YAML.replace("num_requests: 48", "num_requests: 2"))
    fb = TimelineProbe().execute({"lead_s": 30, "sample_process": "server", "trace_path": "/no-such-trace",
                                  "loop_stalls": False},
                                 ProbeContext(workdir=tmp_path / "out", workspace=load_workspace(root), progress=False))
    assert fb.ok, fb.error
    assert "timeline" not in fb.meta
    (why,) = [f for f in fb.findings if f.kind == FindingKind.SAMPLER_UNAVAILABLE]
    assert "lead_s" in why.message and "lead_s" in (why.next_question or ""), why
