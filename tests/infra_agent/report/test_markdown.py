"""The Markdown summary."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infra_agent.records import Experiment, RunRecord
from infra_agent.report import render_markdown, write_report
from infra_agent.report.markdown import cell, code, fence, text


@pytest.fixture
def md(tmp_path: Path, run: RunRecord, experiments: list[Experiment]) -> str:
    return write_report(run, experiments, tmp_path).markdown.read_text(encoding="utf-8")


def _section(md: str, title: str) -> str:
    start = md.index(f"## {title}")
    end = md.find("\n## ", start + 1)
    return md[start:] if end < 0 else md[start:end]


def test_header(md: str) -> None:
    head = md.split("\n## ", 1)[0]
    assert head.startswith("# infra-agent report: run `run-20250301-a1b2`")
    for fact in ("`/home/ops/demo-workspace`", "rules", "✓ done", "2025-03-01 12:00:00 UTC", "wall time 20m 34s",
                 "**Experiments:** 6", "**e2e runs:** 21", "**LLM tokens:** 1,250", "> Stopped after 6 experiments"):
        assert fact in head


def test_gate_table_before_fail_after_pass(md: str) -> None:
    gates = _section(md, "Gates")
    row = next(line for line in gates.splitlines() if line.startswith("| throughput-at-least-300 |"))
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1] == "`output_throughput>=300 @chat`"
    assert cells[2] == "✗ fail 262.4 [255.1, 269.8] (in e1)"
    assert cells[3] == "✓ pass 318.2 [309.9, 325] (in e6)"
    assert cells[4] == "95% bootstrap CI of the median over 3 interleaved runs"


def test_tree_lists_every_experiment_nested(md: str, experiments: list[Experiment]) -> None:
    tree = _section(md, "Experiment tree")
    lines = [line for line in tree.splitlines() if line.lstrip().startswith("- **")]
    assert [re.search(r"\*\*(e\d)\*\*", line).group(1) for line in lines] == [e.id for e in experiments]  # type: ignore[union-attr]
    indents = [len(line) - len(line.lstrip()) for line in lines]
    assert indents == [0, 2, 4, 4, 4, 4]
    accepted = [line for line in lines if "ACCEPTED" in line]
    assert len(accepted) == 2 and "best" in accepted[1]
    assert "✗ refuted 0.968 [0.94, 0.995]" in lines[2]
    assert "✗ rejected" in lines[3] and "`kernel` (check)" in lines[4]


def test_accepted_diff_is_fenced(md: str, experiments: list[Experiment]) -> None:
    changes = _section(md, "Accepted changes")
    diff = experiments[5].change.diff
    assert diff is not None
    assert f"```diff\n{diff.rstrip()}\n```" in changes
    assert "Knobs: `max_running=64`" in changes
    # Printed once: the experiment section points to it instead of repeating it.
    assert md.count(diff.rstrip()) == 1
    # The rejected patch is shown under its experiment, with the error.
    e4 = md[md.index("### e4 (#4"):md.index("### e5 (#5")]
    assert "```diff\n--- a/infra-agent.yaml" in e4
    assert "patch touches a protected path: infra-agent.yaml" in e4


def test_plot_table(md: str) -> None:
    plot = _section(md, "Best output_throughput")
    rows = [line for line in plot.splitlines() if re.match(r"^\| \d+ \|", line)]
    assert [r.split("|")[2].strip() for r in rows] == ["e1 ★", "e2 ★", "e3", "e6 ★"]
    assert [r.split("|")[4].strip() for r in rows] == ["262.4", "311", "311", "318.2"]  # best so far
    assert "Criterion >= 300 tok/s." in plot


def test_findings_and_next_question(md: str) -> None:
    e5 = md[md.index("### e5 (#5"):md.index("### e6 (#6, parent")]
    findings = [line for line in e5.splitlines() if line.startswith("  - [")]
    assert len(findings) == 5 and findings[0].startswith("  - [error] `mismatch`")
    assert "next: Is the split-K reduction order different from the reference?" in e5
    assert "… and 1 more" in e5


def test_html_in_text_is_made_inert(md: str) -> None:
    assert "<script" not in md
    assert "&lt;script>alert('x')&lt;/script>" in md
    # Operators stay readable.
    assert "`p99_ttft_ms<=1.1 @chat`" in md


def test_helpers() -> None:
    assert text("a\nb  <b>x</b> 1 < 2") == "a b &lt;b>x&lt;/b> 1 < 2"
    assert cell("a|b") == "a\\|b"
    assert code("x`y") == "``x`y``"
    assert code("") == "–"
    assert fence("```\nx", "diff").startswith("````diff\n")


def test_empty_run(run: RunRecord) -> None:
    md = render_markdown(run.model_copy(update={"gates_before": [], "gates_after": []}), [])
    assert "No gates were evaluated." in md
    assert "No experiments and no failing criterion: nothing to plot." in md
    assert "No change was accepted" in md
