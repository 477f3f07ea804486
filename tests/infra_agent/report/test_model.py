"""The view model: tree, accepted path, series choice."""

from __future__ import annotations

from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.records import Experiment, RunRecord
from infra_agent.report import build_model
from infra_agent.report.fmt import fmt_duration, fmt_num
from infra_agent.report.plot import nice_step


def test_tree_order_depths_and_glyphs(run: RunRecord, experiments: list[Experiment]) -> None:
    m = build_model(run, list(reversed(experiments)))  # input order does not matter
    assert [x.id for x in m.experiments] == ["e1", "e2", "e3", "e4", "e5", "e6"]
    assert [x.depth for x in m.experiments] == [0, 1, 2, 2, 2, 2]
    assert [x.glyph for x in m.experiments] == ["", "└─ ", "   ├─ ", "   ├─ ", "   ├─ ", "   └─ "]
    assert m.path == ["e1", "e2", "e6"]
    assert [x.id for x in m.accepted] == ["e2", "e6"]
    assert m.best == "e6" and [x.id for x in m.experiments if x.best] == ["e6"]


def test_path_without_run_best_uses_the_last_accepted(run: RunRecord, experiments: list[Experiment]) -> None:
    m = build_model(run.model_copy(update={"best": None}), experiments)
    assert m.path == ["e1", "e2", "e6"]


def test_orphans_are_roots(run: RunRecord, experiments: list[Experiment]) -> None:
    experiments[2].parent = "gone"
    m = build_model(run, experiments)
    assert {x.id: x.depth for x in m.experiments}["e3"] == 0


def test_series_uses_the_failing_criterion_and_its_scenario(run: RunRecord, experiments: list[Experiment]) -> None:
    s = build_model(run, experiments).series
    assert (s.metric, s.scenario, s.unit, s.direction) == ("output_throughput", "chat", "tok/s", "higher")
    assert [(p.id, round(p.value, 1)) for p in s.points] == [("e1", 262.4), ("e2", 311.0), ("e3", 301.0),
                                                             ("e6", 318.2)]
    assert [p.id for p in s.best] == ["e1", "e2", "e6"]
    assert s.target == 300


def test_series_falls_back_to_the_most_common_hypothesis_metric(run: RunRecord,
                                                                experiments: list[Experiment]) -> None:
    passing = [g.model_copy(update={"outcome": "pass"}) for g in run.gates_before]
    s = build_model(run.model_copy(update={"gates_before": passing}), experiments).series
    assert s.metric == "output_throughput" and s.scenario == "chat" and s.target is None
    assert "most common hypothesis metric" in s.source


def test_series_relative_gate_target_is_a_multiple_of_the_baseline(run: RunRecord,
                                                                   experiments: list[Experiment]) -> None:
    rel = run.gates_before[1].model_copy(update={"outcome": "fail"})
    s = build_model(run.model_copy(update={"gates_before": [rel]}), experiments).series
    assert s.metric == "p99_ttft_ms" and s.direction == "lower"
    assert s.target is not None and abs(s.target - 1.1 * s.points[0].value) < 1e-9


def test_series_untagged_measurements_count_for_the_scenario(run: RunRecord, experiments: list[Experiment]) -> None:
    experiments[0].feedback = Feedback(probe="serving", tier=Tier.e2e, measurements=[
        Measurement.from_samples("output_throughput", "tok/s", [250.0, 251.0, 252.0])])
    s = build_model(run, experiments).series
    assert s.points[0].value == 251.0


def test_formatting() -> None:
    assert fmt_num(262.4) == "262.4" and fmt_num(12345.6) == "12,346" and fmt_num(None) == "–"
    assert fmt_num(0.00012) == "1.200e-04" and fmt_num(float("nan")) == "–"
    assert fmt_duration(0.02) == "0.02 s" and fmt_duration(95.2) == "1m 35s" and fmt_duration(3725) == "1h 02m 05s"
    assert [nice_step(x) for x in (100, 7, 0.3)] == [20, 2, 0.1]


def test_the_baseline_card_names_the_runs_that_measured_it(run: RunRecord) -> None:
    # The loop measures the baseline itself (no planned probe): its card used to say "Probe: not run".
    from infra_agent.records import Cost, Hypothesis
    from infra_agent.report import render_markdown

    base = Experiment(id="e0", run_id=run.id, seq=0, role="baseline", proposer="-", status="done",
                      hypothesis=Hypothesis(statement="baseline: the workspace as given", metric="-", direction="higher"),
                      feedback=Feedback(probe="serving", tier=Tier.e2e, measurements=[
                          Measurement.from_samples("output_throughput", "tok/s", [250.0, 251.0, 249.0], "higher")]),
                      cost=Cost(wall_s=31.0, tier=Tier.e2e, e2e_runs=3, probe_runs=1))
    run = run.model_copy(update={"baseline": "e0", "best": "e0"})
    view = next(x for x in build_model(run, [base]).experiments if x.id == "e0")
    assert (view.probe, view.probe_tier) == ("serving", "e2e")
    assert view.probe_reason == "the baseline's own measurement: 3 e2e run(s) + 1 check run(s)"
    md = render_markdown(run, [base])
    assert "**Probe:** not run" not in md and "3 e2e run(s)" in md


def test_a_count_fix_shows_its_move_not_a_zero_interval(run: RunRecord, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # failed_checks 3 -> 0 was "effect 0 [0, 0]" on the card, the tree and the hypothesis gate.
    from infra_agent.agent.executors.base import Execution
    from infra_agent.agent.planner import Plan
    from infra_agent.judge.accept import judge
    from infra_agent.records import Hypothesis, ProbeCall
    from infra_agent.report import render_html, render_markdown
    from infra_agent.workspace import load_workspace

    from ..agent.loop_workspace import make_workspace

    def checks(n: int) -> Feedback:
        return Feedback(probe="kernel-check", tier=Tier.check, ok=n == 0, meta={"failed_checks": n})

    ws = load_workspace(make_workspace(tmp_path / "ws", criteria=[]))
    plan = Plan(probe=ProbeCall(name="kernel-check", tier=Tier.check), mode="pair", check="tp-checks")
    base = Experiment(id="e0", run_id=run.id, seq=0, role="baseline", proposer="-", status="done",
                      hypothesis=Hypothesis(statement="baseline", metric="-", direction="higher"))
    fix = Experiment(id="e1", run_id=run.id, seq=1, parent="e0", status="done", probe=plan.probe, feedback=checks(0),
                     baseline_feedback=checks(3),
                     hypothesis=Hypothesis(statement="fp32 accumulation fixes the TP checks", metric="failed_checks",
                                           direction="lower", min_effect=1))
    fix.verdict = judge(ws, fix, Execution(status="done", baseline={"tp-checks": [checks(3)]},
                                           candidate={"tp-checks": [checks(0)]}), plan, {})
    assert fix.verdict.outcome == "supported" and (fix.verdict.low, fix.verdict.high) == (0, 0)
    run = run.model_copy(update={"baseline": "e0", "best": "e1"})
    view = next(x for x in build_model(run, [base, fix]).experiments if x.id == "e1")
    assert (view.effect, view.effect_interval, view.effect_label) == ("3 → 0", "(exact count)", "")
    hyp_cell = next(c for name, c in view.gates if name == "failed_checks <= baseline - 1")
    assert (hyp_cell.value, hyp_cell.interval) == ("0", "(exact count)")
    md = render_markdown(run, [base, fix])
    assert "- **Verdict:** ✓ supported, effect 3 → 0 (exact count), accepted" in md
    assert "`failed_checks <= baseline - 1`: ✓ pass 0 (exact count) (in e1)" in md
    assert "[0, 0]" not in md
    html = render_html(run, [base, fix])
    assert '<span class="num">3 → 0</span> <span class="ci">(exact count)</span>' in html and "[0, 0]" not in html
