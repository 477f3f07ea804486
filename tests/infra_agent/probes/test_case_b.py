"""Case study B end to end, reduced for CI: the kv-transfer workspace's check run by the
timeline probe on a real disaggregated refstack, first with the EP section holding the GIL
(the baseline), then releasing it.

What is asserted is what holds on a busy 2-core machine: the measured ratio exists for both
configurations, and the *attribution* and its direction, which come from py-spy's GIL
owners, not from the clock:

1. baseline (``ep_release_gil: false``): the kv-transfer thread waited on the GIL while the
   engine thread held it inside ``ep.dispatch|ep.combine``: a ``gil_contention`` finding
   located at component ``comm`` that names the knob ``ep_release_gil``; during the EP
   spans the engine thread owned the GIL;
2. with ``ep_release_gil: true``: no such finding, and the engine thread no longer owns
   the GIL during the EP spans (the transfer thread may).

The throughput gap itself (> 5% held, within 5% released) swings with the machine's load
over windows this short; it is printed here and measured with more pairs in
docs/performance.md ("Case study B").

Opt-in (``INFRA_AGENT_CASE_B=1``): beside the rest of the suite on a 2-core box the GIL shares
this finding reads sit at its 50% threshold.  The EP link's time is modelled and fixed, the
machine's work slows with its load, and about half of the transfer thread's GIL-free time has
no owner at all (its own I/O, or no CPU): in a clean-clone suite run the loop test's window read
63% waited, 49.9% of it held by the EP section; alone on the box the finding clears both
thresholds (docs/performance.md, "The test suite on a 2-core AVX2 machine").  The finding now
also reads the holder against the wait for the GIL itself (dump snapshots' ``gil_wait``), which
the transfer thread's own sends do not dilute: beside three busy loops the EP holder read 0.655
and 0.772 of the whole wait and 1.0 of the wait for the GIL (2026-12-07); the test stays opt-in
until a clean-clone suite run shows the EP section's own owner share (0.73 there) holds beside it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra_agent.feedback import Feedback, Finding
from infra_agent.probes.base import ProbeContext
from infra_agent.probes.timeline import TimelineProbe
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kv-transfer"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("INFRA_AGENT_CASE_B") != "1",
                     reason="load-sensitive: set INFRA_AGENT_CASE_B=1 to run (see the module docstring)"),
    pytest.mark.skipif(shutil.which("py-spy") is None, reason="the attribution needs py-spy"),
    pytest.mark.skipif(importlib.util.find_spec("refstack.disagg") is None, reason="no refstack.disagg"),
]


def _run(tmp_path: Path, release: bool) -> Feedback:
    """The example's check (the timeline probe comparing kv_transfer off/on), reduced: 16
    requests a window, one interleaved pair, then the traced and sampled window."""
    data = yaml.safe_load((EXAMPLE / "infra-agent.yaml").read_text())
    check = next(c for c in data["checks"] if c["name"] == "kv-transfer-prefill-ratio")
    data["checks"] = []
    data["scenarios"]["prefill"]["num_requests"] = 16
    # A quarter of the example's modelled EP link (0.02 Gbps, calibrated on a quiet 2-core box), so
    # the GIL hold this test attributes stands clear of the finding's 50% thresholds on any host
    # and under load.  The link's time is modelled and fixed while the machine's work slows with
    # its load, so a loaded box shrinks the EP section's share: at 0.02 on a 16-core GPU host the
    # transfer thread waited only 53-68% of its sampled time; at 0.01 beside two busy loops on
    # the 2-core box the EP holder held 51% of the wait, and beside the rest of the suite under
    # 50%; at 0.005 beside three busy loops, 98% waited and 77% of it held by the EP section.
    data["knobs"]["ep_link_gbps"]["default"] = 0.005
    root = tmp_path / f"ws-{release}"
    root.mkdir(parents=True)
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    ws = load_workspace(root)
    cfg = dict(check["config"], compare_pairs=1, repeats=1, lead_s=0.3)
    cfg.pop("min_ratio")  # measured and reported, not gated: one pair on a shared box is no verdict
    fb = TimelineProbe().execute(cfg, ProbeContext(workdir=tmp_path / f"out-{release}", workspace=ws, progress=False,
                                                   knobs={"ep_release_gil": release}))
    assert fb.ok, fb.error
    Feedback.model_validate(fb.model_dump(mode="json"))
    return fb


def _ep_finding(fb: Feedback) -> Finding | None:
    return next((f for f in fb.findings if f.kind == FindingKind.GIL_CONTENTION and f.location is not None
                 and f.location.component == "comm" and f.location.knob == "ep_release_gil"), None)


def _ep_holders(fb: Feedback) -> dict[str, float]:
    """GIL owner shares during the EP spans, by thread (from the py-spy dumps)."""
    report: dict[str, Any] = fb.meta["timeline"]["report"]
    (expected,) = [e for e in report["expected_overlap"] if e["b"] == "ep.dispatch|ep.combine"]
    out: dict[str, float] = {}
    for h in expected["holders_during_b"]:
        out[str(h["thread"]).split("[")[0]] = out.get(str(h["thread"]).split("[")[0], 0.0) + float(h["share"])
    return out


def test_case_b_the_held_gil_is_found_in_the_ep_section_and_releasing_it_moves_the_transfer_there(tmp_path: Path) -> None:
    held = _run(tmp_path, release=False)
    assert held.meta["timeline"]["sampled_process"]["name"] == "prefill-worker"
    threads = {m.tags.get("thread") for m in held.measurements if m.name == "thread_busy_share"}
    assert "kv-transfer" in threads
    ratio_held = next(m for m in held.measurements if m.name == "kv_transfer_prefill_ratio")
    assert len(ratio_held.samples) == 1 and ratio_held.samples[0] > 0 and held.meta["compare"]["own"] is True
    # the configuration's own windows lead (the judge reads the first match); the other arm is tagged
    first = next(m for m in held.measurements if m.name == "total_token_throughput")
    assert "knob" not in first.tags
    assert any(m.tags.get("knob") == "kv_transfer=false" for m in held.measurements if m.name == "input_throughput")
    assert any(m.name == "overlap_share" for m in held.measurements)
    finding = _ep_finding(held)
    # on a miss, the window's GIL waits as the finding saw them (which threshold it fell under)
    waits = [{k: w.get(k) for k in ("group", "thread", "waiting_share", "waiting_us", "holder_threads")}
             for w in held.meta["timeline"].get("report", {}).get("waits", [])]
    assert finding is not None, ([f"{f.kind}: {f.message}" for f in held.findings], waits)
    assert finding.location is not None and finding.location.thread.startswith("engine-loop")
    assert set(str(finding.location.span).split("|")) <= {"ep.dispatch", "ep.combine"}
    assert finding.evidence["waiting_thread"] == "kv-transfer" and "ep_release_gil" in (finding.next_question or "")
    holders_held = _ep_holders(held)
    assert holders_held.get("engine-loop", 0.0) >= 0.5, holders_held

    released = _run(tmp_path, release=True)
    ratio_released = next(m for m in released.measurements if m.name == "kv_transfer_prefill_ratio")
    assert len(ratio_released.samples) == 1 and ratio_released.samples[0] > 0
    assert _ep_finding(released) is None, [f.message for f in released.findings]
    holders_released = _ep_holders(released)
    assert holders_released.get("engine-loop", 0.0) < holders_held["engine-loop"] / 2, (holders_held, holders_released)
    print(f"kv_transfer on/off, one pair each: ep_release_gil=false {ratio_held.samples[0]:.3f}, "
          f"true {ratio_released.samples[0]:.3f}; GIL owners during EP: held {holders_held}, released {holders_released}; "
          f"the finding: waited {finding.evidence['waiting_share']:.3f}, for the GIL itself "
          f"{(finding.evidence['gil_wait_us'] or 0) / max(finding.evidence['waiting_us'], 1):.3f} of that, the EP holder "
          f"{finding.evidence['holder_thread_share']:.3f} of the wait, {finding.evidence['holder_gil_wait_share']} of the wait for the GIL")
