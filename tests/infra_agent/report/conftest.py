"""A realistic run: a baseline, an accepted knob change, a refuted one, a rejected patch
on a protected path, a kernel-tier check and an accepted code patch."""

from __future__ import annotations

import pytest

from infra_agent.feedback import Feedback, Finding, Location, Measurement, Tier
from infra_agent.records import (
    Change,
    Cost,
    Experiment,
    GateResult,
    Hypothesis,
    ProbeCall,
    RunRecord,
    Verdict,
)

T0 = 1_740_830_400.0
CI_LABEL = "95% bootstrap CI of the median over 3 interleaved runs"

ACCEPTED_DIFF = """\
diff --git a/src/refstack/engine/scheduler.py b/src/refstack/engine/scheduler.py
--- a/src/refstack/engine/scheduler.py
+++ b/src/refstack/engine/scheduler.py
@@ -88,7 +88,9 @@ class Scheduler:
     def admit(self, waiting: deque[Request]) -> list[Request]:
-        budget = self.max_batch_tokens - len(self.running)
+        # Decode tokens first, then whole prefill chunks while the budget lasts.
+        decode = sum(1 for r in self.running if r.decoding)
+        budget = self.max_batch_tokens - decode
         admitted = []
         while waiting and budget > 0:
"""

PROTECTED_DIFF = """\
--- a/infra-agent.yaml
+++ b/infra-agent.yaml
@@ -12,3 +12,3 @@ criteria:
-    value: 300
+    value: 250
"""


def serving_feedback(throughput: list[float], findings: list[Finding] | None = None) -> Feedback:
    return Feedback(
        probe="serving", tier=Tier.e2e, scope=["engine", "server"],
        measurements=[
            Measurement.from_samples("output_throughput", "tok/s", throughput, better="higher", scenario="chat"),
            # Another scenario's number, which the plot must not pick up.
            Measurement.from_samples("output_throughput", "tok/s", [t / 3 for t in throughput], better="higher",
                                     scenario="long"),
            Measurement.from_samples("p99_ttft_ms", "ms", [410.0, 425.0, 398.0], better="lower", scenario="chat"),
        ],
        findings=findings or [],
    )


def gate(name: str, text: str, kind: str, outcome: str, value: float | None, low: float | None = None,
         high: float | None = None, measured_in: str | None = None, message: str = "") -> GateResult:
    return GateResult(name=name, gate=text, kind=kind, outcome=outcome, value=value, low=low, high=high,  # type: ignore[arg-type]
                      interval=CI_LABEL if low is not None else "", measured_in=measured_in, message=message)


def build_run() -> RunRecord:
    return RunRecord(
        id="run-20250301-a1b2", workspace="/home/ops/demo-workspace", proposer="rules", status="done",
        started_at=T0, finished_at=T0 + 1234.5, baseline="e1", best="e6", branch="infra-agent/run-20250301-a1b2",
        gates_before=[
            gate("throughput-at-least-300", "output_throughput>=300 @chat", "absolute", "fail", 262.4, 255.1, 269.8,
                 "e1", "262.4 < 300"),
            gate("ttft-not-worse", "p99_ttft_ms<=1.1 @chat", "relative", "pass", 1.0, 1.0, 1.0, "e1"),
            gate("lm-head-tp", "check lm-head-tp", "check", "pass", None, measured_in="e1"),
        ],
        gates_after=[
            gate("throughput-at-least-300", "output_throughput>=300 @chat", "absolute", "pass", 318.2, 309.9, 325.0,
                 "e6"),
            gate("ttft-not-worse", "p99_ttft_ms<=1.1 @chat", "relative", "pass", 0.93, 0.88, 0.99, "e6"),
            gate("lm-head-tp", "check lm-head-tp", "check", "pass", None, measured_in="e6"),
        ],
        message="Stopped after 6 experiments: every criterion passes on e6 (output_throughput 318 tok/s, +21%).",
    )


def build_experiments() -> list[Experiment]:
    run_id = "run-20250301-a1b2"
    queue = Finding(kind="queue_dominates_ttft", severity="warning",
                    message="queue time is 71% of TTFT at concurrency 12",
                    location=Location(component="engine.scheduler", span="queue"),
                    evidence={"queue_share": 0.71, "concurrency": 12},
                    next_question="Does admitting more running requests (max_running) shorten the queue?")
    info = Finding(kind="bursty_stream", message="token stream gaps above 50 ms in 3% of chunks",
                   location=Location(component="server"))
    e1 = Experiment(
        id="e1", run_id=run_id, seq=1, proposer="rules",
        hypothesis=Hypothesis(statement="The baseline configuration, measured for reference.",
                              metric="output_throughput", direction="higher", scenario="chat"),
        probe=ProbeCall(name="serving", tier=Tier.e2e, reason="the criteria are end-to-end"),
        status="done", feedback=serving_feedback([258.0, 262.4, 266.9], [info, queue]),
        cost=Cost(wall_s=95.2, tier=Tier.e2e, e2e_runs=3), knobs={"max_running": 32, "max_batch_tokens": 512},
        started_at=T0 + 5, finished_at=T0 + 100.2,
    )
    e2 = Experiment(
        id="e2", run_id=run_id, seq=2, parent="e1", proposer="rules",
        hypothesis=Hypothesis(statement="Raising max_running from 32 to 64 cuts queueing and lifts output "
                                        "throughput by at least 10%.",
                              metric="output_throughput", direction="higher", min_effect=0.10, scenario="chat",
                              locality=Location(component="engine.scheduler", knob="max_running")),
        change=Change(knobs={"max_running": 64}, description="admit more concurrent requests"),
        probe=ProbeCall(name="serving", tier=Tier.e2e, reason="a scheduler knob: only e2e covers engine.scheduler"),
        status="done", feedback=serving_feedback([305.0, 311.0, 316.2]),
        verdict=Verdict(outcome="supported", effect=1.185, low=1.12, high=1.25, accepted=True,
                        interval="95% paired bootstrap CI of the mean ratio over 3 runs",
                        message="output_throughput ratio 1.185 [1.12, 1.25] clears 1.1",
                        gates=[gate("hypothesis", "output_throughput>=1.1", "hypothesis", "pass", 1.185, 1.12, 1.25)]),
        cost=Cost(wall_s=188.4, tier=Tier.e2e, e2e_runs=6, llm_tokens=0),
        knobs={"max_running": 64, "max_batch_tokens": 512}, commit="3f2a9c1",
    )
    e3 = Experiment(
        id="e3", run_id=run_id, seq=3, parent="e2", proposer="rules",
        hypothesis=Hypothesis(statement="Smaller prefill chunks <script>alert('x')</script> interleave decode "
                                        "better.",
                              metric="output_throughput", direction="higher", min_effect=0.05, scenario="chat",
                              locality=Location(component="engine.scheduler", knob="prefill_chunk")),
        change=Change(knobs={"prefill_chunk": 128}),
        probe=ProbeCall(name="serving", tier=Tier.e2e, reason="e2e"),
        status="done", feedback=serving_feedback([296.0, 301.0, 304.4]),
        verdict=Verdict(outcome="refuted", effect=0.968, low=0.94, high=0.995, interval="95% paired bootstrap CI",
                        message="throughput fell"),
        cost=Cost(wall_s=180.0, tier=Tier.e2e, e2e_runs=6, llm_tokens=1250),
    )
    e4 = Experiment(
        id="e4", run_id=run_id, seq=4, parent="e2", proposer="rules",
        hypothesis=Hypothesis(statement="Relaxing the throughput criterion makes it pass.",
                              metric="output_throughput", direction="higher"),
        change=Change(diff=PROTECTED_DIFF, description="edit the criteria"),
        status="rejected",
        error="patch touches a protected path: infra-agent.yaml (the workspace config is read-only to proposers)",
        cost=Cost(wall_s=0.02),
    )
    kernel_findings = [
        Finding(kind="roofline", message=f"lm_head at {i * 10}% of the memory roofline",
                location=Location(kernel="lm_head", variant="tp2")) for i in range(4)
    ] + [
        Finding(kind="mismatch", severity="error", message="max rel error 3.1e-2 at shape (4096, 32000) bf16",
                location=Location(kernel="lm_head", variant="tp2", precision="bf16", file="src/refstack/model/head.py",
                                  line=41),
                evidence={"max_rel": 0.031, "ulp": 12},
                next_question="Is the split-K reduction order different from the reference?"),
        Finding(kind="repeated_work", severity="warning", message="the norm is recomputed per V tile",
                location=Location(kernel="lm_head")),
    ]
    e5 = Experiment(
        id="e5", run_id=run_id, seq=5, parent="e2", proposer="rules",
        hypothesis=Hypothesis(statement="Splitting the LM head over 2 ranks stays within bf16 tolerance.",
                              metric="failed_checks", direction="lower", min_effect=0,
                              locality=Location(kernel="lm_head", variant="tp2", precision="bf16",
                                                component="model.lm_head")),
        change=Change(knobs={"lm_head_tp": 2}),
        probe=ProbeCall(name="kernel", tier=Tier.check, config={"spec": "lm_head", "seeds": 3},
                        reason="a kernel question: the check tier covers model.lm_head in 0.4 s"),
        status="done",
        feedback=Feedback(probe="kernel", tier=Tier.check, scope=["kernel"],
                          measurements=[Measurement.from_samples("failed_checks", "count", [2.0], better="lower")],
                          findings=kernel_findings),
        verdict=Verdict(outcome="inconclusive", effect=2.0, interval="difference in failed checks",
                        message="2 of 48 cases fail only at the largest shape; more seeds needed"),
        cost=Cost(wall_s=0.41, tier=Tier.check, probe_runs=1),
    )
    e6 = Experiment(
        id="e6", run_id=run_id, seq=6, parent="e2", proposer="rules",
        hypothesis=Hypothesis(statement="Budgeting decode tokens before prefill chunks lifts throughput by 2%.",
                              metric="output_throughput", direction="higher", min_effect=0.02, scenario="chat",
                              locality=Location(file="src/refstack/engine/scheduler.py", line=88,
                                                component="engine.scheduler")),
        change=Change(diff=ACCEPTED_DIFF, description="count only decode tokens against the step budget"),
        probe=ProbeCall(name="serving", tier=Tier.e2e, reason="code change in engine.scheduler"),
        status="done", feedback=serving_feedback([312.0, 318.2, 322.5]),
        verdict=Verdict(outcome="supported", effect=1.023, low=1.011, high=1.036, accepted=True,
                        interval="95% paired bootstrap CI of the mean ratio over 3 runs"),
        cost=Cost(wall_s=201.7, tier=Tier.e2e, e2e_runs=6, llm_tokens=0),
        knobs={"max_running": 64, "max_batch_tokens": 512}, commit="9be41d0",
    )
    return [e1, e2, e3, e4, e5, e6]


@pytest.fixture
def run() -> RunRecord:
    return build_run()


@pytest.fixture
def experiments() -> list[Experiment]:
    return build_experiments()


def host_load(foreign: list[float], load: list[float]) -> list[Measurement]:
    """What the serving probe records once per window: CPU used outside the experiment, and the load average."""
    return [Measurement.from_samples("host_foreign_cpu", "cores", foreign),
            Measurement.from_samples("host_load_1m", "load", load)]


def build_decided_experiments() -> list[Experiment]:
    """The run above plus every other way a decision ends: supported but held back by a guard, an
    inconclusive ratio on a lower-is-better metric, a timeout, and the confirmation; e2 and e3
    carry the machine load of their windows (e2 on both sides, e3 on the candidate's only)."""
    exps = build_experiments()
    e2, e3 = exps[1], exps[2]
    assert e2.feedback is not None and e3.feedback is not None
    e2.feedback.measurements += host_load([0.2, 1.8, 0.5], [2.0, 3.5, 2.5])
    e2.baseline_feedback = Feedback(probe="serving", tier=Tier.e2e, measurements=[
        Measurement.from_samples("output_throughput", "tok/s", [258.0, 262.0, 266.0], better="higher", scenario="chat"),
        *host_load([0.1, 0.6, 0.3], [2.2, 2.4, 2.1])])
    e3.feedback.measurements += host_load([3.0], [6.5])
    # The kernel check on the parent's side: the count the candidate's is compared with.
    exps[4].baseline_feedback = Feedback(probe="kernel", tier=Tier.check, measurements=[
        Measurement.from_samples("failed_checks", "count", [4.0], better="lower")])
    hyp = Hypothesis(statement="Caching the tokenizer output lifts throughput by 2%.", metric="output_throughput",
                     direction="higher", min_effect=0.02, scenario="chat")
    e7 = Experiment(
        id="e7", run_id=exps[0].run_id, seq=7, parent="e6", proposer="rules", hypothesis=hyp,
        change=Change(knobs={"tokenizer_cache": True}), probe=ProbeCall(name="serving", tier=Tier.e2e),
        status="done", feedback=serving_feedback([330.0, 333.0, 336.0]),
        verdict=Verdict(outcome="supported", effect=1.06, low=1.03, high=1.09, accepted=False, interval=CI_LABEL,
                        message="not accepted (promising, a guard undecided): ttft-not-worse is inconclusive"),
        cost=Cost(wall_s=190.0, tier=Tier.e2e, e2e_runs=6))
    e8 = Experiment(
        id="e8", run_id=exps[0].run_id, seq=8, parent="e6", proposer="rules",
        hypothesis=Hypothesis(statement="A smaller first chunk cuts p99 TTFT by 5%.", metric="p99_ttft_ms",
                              direction="lower", min_effect=0.05, scenario="chat"),
        change=Change(knobs={"first_chunk": 64}), probe=ProbeCall(name="serving", tier=Tier.e2e),
        status="done", feedback=serving_feedback([318.0, 320.0, 321.0]),
        verdict=Verdict(outcome="inconclusive", effect=0.97, low=0.91, high=1.03, interval=CI_LABEL,
                        message="the interval straddles 0.952"),
        cost=Cost(wall_s=185.0, tier=Tier.e2e, e2e_runs=6))
    e9 = Experiment(
        id="e9", run_id=exps[0].run_id, seq=9, parent="e6", proposer="rules", hypothesis=hyp,
        change=Change(knobs={"max_batch_tokens": 4096}), probe=ProbeCall(name="serving", tier=Tier.e2e),
        status="timeout", error="the server did not answer within 600 s", cost=Cost(wall_s=600.0, tier=Tier.e2e))
    confirm_hyp = Hypothesis(statement="the accepted changes together hold every gate against the baseline",
                             metric="output_throughput", direction="higher", scenario="chat")
    e10 = Experiment(
        id="e10", run_id=exps[0].run_id, seq=10, parent="e6", role="confirm", proposer="-", hypothesis=confirm_hyp,
        probe=ProbeCall(name="serving", tier=Tier.e2e, reason="confirmation: the best against the baseline"),
        status="done", feedback=serving_feedback([316.0, 318.0, 321.0]),
        baseline_feedback=serving_feedback([259.0, 262.0, 265.0]),
        # A confirmation's verdict has no effect of its own: the ratio is in its hypothesis gate.
        verdict=Verdict(outcome="confirmed", message="every gate holds against the baseline",
                        gates=[gate("hypothesis", "output_throughput>=1", "hypothesis", "pass", 1.21, 1.17, 1.25)]),
        cost=Cost(wall_s=200.0, tier=Tier.e2e, e2e_runs=6))
    return [*exps, e7, e8, e9, e10]


@pytest.fixture
def decided() -> list[Experiment]:
    return build_decided_experiments()
