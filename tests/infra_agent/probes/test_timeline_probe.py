"""The timeline probe: registry, scope, routing, the EP/GIL rule, and runs on a real refstack."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra_agent.agent.planner import Planner
from infra_agent.agent.proposers.base import LoopState
from infra_agent.agent.proposers.rules import RulesProposer
from infra_agent.errors import ConfigError
from infra_agent.feedback import Feedback, Finding, Location, Tier
from infra_agent.probes.base import ProbeContext, get_probe, registered_probes
from infra_agent.probes.timeline import TimelineProbe
from infra_agent.probes.timeline_locate import locate
from infra_agent.records import Experiment, Hypothesis, RunRecord, Step
from infra_agent.vocabulary import FindingKind
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kv-transfer"


def _example(tmp_path: Path, *, checks: bool = True, scenario: dict[str, Any] | None = None) -> Any:
    """The kv-transfer example workspace, copied (its ledger and logs land in tmp), optionally reduced."""
    data = yaml.safe_load((EXAMPLE / "infra-agent.yaml").read_text())
    if not checks:
        data["checks"] = []
    if scenario:
        data["scenarios"]["prefill"].update(scenario)
    root = tmp_path / "kv-transfer"
    root.mkdir(parents=True, exist_ok=True)
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    return load_workspace(root)


def test_registered_with_its_tier_metrics_and_scope() -> None:
    assert registered_probes()["timeline"] == "infra_agent.probes.timeline:TimelineProbe"
    cls = get_probe("timeline")
    assert cls is TimelineProbe and cls.tier() == Tier.trace
    for metric in ("total_token_throughput", "p99_ttft_ms", "overlap_share", "gil_wait_share", "kv_transfer_prefill_ratio"):
        assert cls.measures(metric), metric
    assert not cls.measures("failed_checks")
    assert cls.covers(Location(component="comm", thread="kv-transfer", span="ep.dispatch"))
    assert cls.covers(Location(component="kv_transfer"))
    assert not cls.covers(Location(kernel="lm_head"))
    assert not cls.covers(Location(component="client"))
    with pytest.raises(ConfigError):
        cls.parse_config({"trace_knob": {"trace": True}})


def test_a_gil_finding_in_an_ep_span_is_located_at_comm_with_the_one_knob_there(tmp_path: Path) -> None:
    ws = _example(tmp_path)
    f = Finding(kind=FindingKind.GIL_CONTENTION, message="m", next_question="Release it?",
                location=Location(thread="engine-loop", span="ep.dispatch|ep.combine", component="runtime", file="moe.py"))
    locate(f, {"ep": "comm"}, {"ep.dispatch": "ep", "ep.combine": "ep"}, ws, {})
    assert f.location is not None and f.location.component == "comm" and f.location.knob == "ep_release_gil"
    assert "ep_release_gil" in (f.next_question or "")
    # No span: the default component (runtime) names no knob, though one workspace knob acts there.
    g = Finding(kind=FindingKind.GIL_CONTENTION, message="m", location=Location(thread="engine-loop", component="runtime"))
    locate(g, {"ep": "comm"}, {}, ws, {})
    assert g.location is not None and g.location.component == "runtime" and g.location.knob is None


def _state(ws: Any, findings: list[Finding]) -> LoopState:
    run = RunRecord(id="r", workspace=str(ws.root), proposer="rules", started_at=time.time())
    best = Experiment(id="e0", run_id="r", seq=0, role="baseline", knobs=dict(ws.resolve_knobs()),
                      hypothesis=Hypothesis(statement="b", metric="-", direction="higher"))
    return LoopState(workspace=ws, run=run, best=best, history=[best],
                     feedback=[Feedback(probe="timeline", tier=Tier.trace, findings=findings)])


GIL = Finding(kind=FindingKind.GIL_CONTENTION, severity="warning", message="kv waited on the GIL",
              location=Location(file="/x/refstack/model/moe.py", line=88, thread="engine-loop",
                                span="ep.dispatch|ep.combine", component="comm", knob="ep_release_gil"),
              evidence={"waiting_thread": "kv-transfer", "waiting_share": 0.97, "scenario": "prefill"})


def test_the_rules_proposer_releases_the_gil_from_the_finding_and_the_planner_routes_to_the_timeline(tmp_path: Path) -> None:
    ws = _example(tmp_path, checks=False)
    step = RulesProposer().propose(_state(ws, [GIL]))
    assert step is not None and step.change.knobs == {"ep_release_gil": True}
    h = step.hypothesis
    assert h.metric == "total_token_throughput" and h.direction == "higher" and h.scenario == "prefill"
    assert "kv-transfer waited 97%" in h.statement and "ep.dispatch|ep.combine" in h.statement
    assert h.locality.span == "ep.dispatch|ep.combine" and h.locality.knob == "ep_release_gil"
    changed = [c for k in step.change.knobs for c in ws.knobs[k].components]
    plan = Planner(ws).plan(step, changed)
    assert plan.probe.name == "timeline" and plan.probe.tier == Tier.trace and plan.mode == "ab"
    assert plan.scenarios == ["prefill"] and "total_token_throughput" in plan.result_metrics
    # A thread hypothesis no check covers also goes to the timeline, never to the serving probe.
    thread_step = Step(hypothesis=Hypothesis(statement="s", metric="median_ttft_ms", direction="lower",
                                             locality=Location(thread="kv-transfer")))
    assert Planner(ws).plan(thread_step, []).probe.name == "timeline"
    # With the example's check (the timeline probe comparing kv_transfer), the check answers it, once per side.
    full = _example(tmp_path / "full")
    plan = Planner(full).plan(step, changed)
    assert plan.probe.name == "timeline" and plan.mode == "pair" and plan.check == "kv-transfer-prefill-ratio"


def test_a_finding_elsewhere_does_not_fire_the_ep_rule(tmp_path: Path) -> None:
    ws = _example(tmp_path, checks=False)
    other = GIL.model_copy(update={"location": Location(thread="engine-loop", component="runtime")})
    step = RulesProposer().propose(_state(ws, [other]))
    assert step is None or "ep_release_gil" not in step.change.knobs


# ---------------------------------------------------------------------- on a real refstack

PLAIN_YAML = """
target:
  kind: server
  command: refstack serve --preset tiny --port {port} --trace {trace}
  ready_url: /health
  ready_timeout_s: 120
  model: refstack-tiny
knobs:
  trace: {type: bool, default: false, components: [server], help: spans for /debug/trace}
scenarios:
  s:
    dataset: {kind: random, input_len: 32, output_len: 16, seed: 0}
    num_requests: 6
    max_concurrency: 3
    request_rate: inf
"""


@pytest.mark.slow
def test_spans_only_when_py_spy_is_refused_on_a_plain_traced_refstack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from infra_agent.trace import sampler

    real_init = sampler.PySpyDumpSampler.__init__

    def no_py_spy(self: Any, pid: int, out: Any, interval_s: float = 0.0, executable: str = "py-spy") -> None:
        real_init(self, pid, out, interval_s, executable="py-spy-not-installed")

    monkeypatch.setattr(sampler.PySpyDumpSampler, "__init__", no_py_spy)
    root = tmp_path / "plain"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(PLAIN_YAML)
    ws = load_workspace(root)
    # lead_s 0: sample at once (the window is short); the trace knob is turned on by trace_knobs.
    fb = TimelineProbe().execute({"lead_s": 0, "sample_process": "server"},
                                 ProbeContext(workdir=tmp_path / "out", workspace=ws, progress=False))
    assert fb.ok, fb.error
    Feedback.model_validate(fb.model_dump(mode="json"))  # what the executor's worker sends back
    names = {m.name for m in fb.measurements}
    assert {"output_throughput", "total_token_throughput", "ttft_ms", "thread_busy_share"} <= names
    kinds = {f.kind for f in fb.findings}
    assert FindingKind.SAMPLER_UNAVAILABLE in kinds
    assert FindingKind.OVERLAP_UNMEASURABLE in kinds  # one engine thread: nothing to overlap
    merged = [a for a in fb.artifacts if a.path.endswith(".perfetto.json")]
    assert merged and Path(merged[0].path).stat().st_size > 0


# The kv-transfer example on a real disaggregated refstack (case study B, held and released):
# tests/infra_agent/probes/test_case_b.py.


@pytest.mark.slow
def test_profile_adds_the_targets_kineto_trace_to_the_timeline(tmp_path: Path) -> None:
    """``profile: true``: the target's torch.profiler runs over the traced window (refstack's
    /start_profile, /stop_profile), and its Kineto trace joins the span trace on one clock."""
    root = tmp_path / "plain"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(PLAIN_YAML)
    ws = load_workspace(root)
    fb = TimelineProbe().execute({"lead_s": 0, "sample": False, "profile": True},
                                 ProbeContext(workdir=tmp_path / "out", workspace=ws, progress=False))
    assert fb.ok, fb.error
    kineto = [a for a in fb.artifacts if "Kineto" in a.description]
    assert len(kineto) == 1 and Path(kineto[0].path).parent == tmp_path / "out" and Path(kineto[0].path).is_file()
    sources = fb.meta["timeline"]["report"]["sources"]
    assert [s["format"] for s in sources] == ["ours", "kineto"] and sources[1]["spans"] > 0
    assert not [w for w in fb.meta["timeline"]["report"]["warnings"] if "profiler" in w]
