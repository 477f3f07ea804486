"""The HTML report, read back with the standard library's HTML parser."""

from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from infra_agent.records import Experiment, RunRecord
from infra_agent.report import ReportPaths, render_html, write_report


class Page(HTMLParser):
    """Every start tag with its attributes, the text, the text of each <pre>, and the gate table's cells."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self.pres: list[str] = []
        self.style = ""
        self.gate_rows: list[list[str]] = []
        self._pre_depth = 0
        self._in_style = False
        self._table: list[str] = []  # classes of the open tables
        self._cell: list[str] | None = None
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "pre":
            self._pre_depth += 1
            self.pres.append("")
        elif tag == "style":
            self._in_style = True
        elif tag == "table":
            self._table.append(a.get("class", ""))
        elif tag == "tr" and self._table and self._table[-1] == "gates":
            self.gate_rows.append([])
        elif tag == "td" and self._table and self._table[-1] == "gates":
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag == "pre":
            self._pre_depth -= 1
        elif tag == "style":
            self._in_style = False
        elif tag == "table" and self._table:
            self._table.pop()
        elif tag == "td" and self._cell is not None:
            self.gate_rows[-1].append(" ".join("".join(self._cell).split()))
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._in_style:
            self.style += data
            return
        self.text.append(data)
        if self._pre_depth:
            self.pres[-1] += data
        if self._cell is not None:
            self._cell.append(data)

    @property
    def all_text(self) -> str:
        return "".join(self.text)

    def find(self, tag: str, cls: str | None = None) -> list[dict[str, str]]:
        return [a for t, a in self.tags if t == tag and (cls is None or cls in a.get("class", "").split())]


@pytest.fixture
def written(tmp_path: Path, run: RunRecord, experiments: list[Experiment]) -> ReportPaths:
    return write_report(run, experiments, tmp_path / "out")


@pytest.fixture
def page(written: ReportPaths) -> Page:
    return Page(written.html.read_text(encoding="utf-8"))


def test_write_report_writes_both_files(written: ReportPaths, tmp_path: Path) -> None:
    assert written.html == tmp_path / "out" / "report.html"
    assert written.markdown == tmp_path / "out" / "report.md"
    assert written.html.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert written.markdown.read_text(encoding="utf-8").startswith("# infra-agent report")
    assert sorted(p.name for p in written.html.parent.iterdir()) == ["report.html", "report.md"]  # no temp files left


def test_no_external_resources(page: Page, written: ReportPaths) -> None:
    for tag, attrs in page.tags:
        for key in ("src", "href", "action", "srcset", "poster", "data"):
            value = attrs.get(key, "").strip().lower()
            assert not re.match(r"^(https?:)?//", value), f"<{tag} {key}={value}> loads from the network"
        assert tag not in ("script", "iframe", "object", "embed", "img", "link"), f"<{tag}> in a self-contained report"
    # Links stay inside the page.
    assert all(a["href"].startswith("#") for a in page.find("a"))
    assert "@import" not in page.style and "url(" not in page.style
    assert page.find("style"), "the stylesheet is inline"


def test_header_facts(page: Page) -> None:
    text = " ".join(page.all_text.split())
    for fact in ("run-20250301-a1b2", "/home/ops/demo-workspace", "rules", "2025-03-01 12:00:00 UTC",
                 "2025-03-01 12:20:34 UTC", "20m 34s", "1,250", "Stopped after 6 experiments"):
        assert fact in text
    # e2e runs summed over the experiments: 3 + 6 + 6 + 6.
    assert re.search(r"e2e runs\s*21", text, re.IGNORECASE)


def test_gate_table_before_fail_after_pass(page: Page) -> None:
    def row(name: str) -> list[str]:
        (found,) = [r for r in page.gate_rows if r and r[0].startswith(name)]
        return found

    assert len([r for r in page.gate_rows if r]) == 3
    _, condition, before, after = row("throughput-at-least-300")
    assert "output_throughput>=300 @chat" in condition
    assert before.startswith("fail 262.4 [255.1, 269.8]")
    assert "95% bootstrap CI of the median over 3 interleaved runs" in before
    assert "measured in e1" in before
    assert after.startswith("pass 318.2 [309.9, 325]") and "measured in e6" in after
    assert row("lm-head-tp")[2].startswith("pass") and row("ttft-not-worse")[3].startswith("pass 0.93")
    fail_badges = [a for a in page.find("span", "b-red")]
    assert fail_badges, "a failing gate is shown in red"


def test_every_experiment_is_in_the_tree_and_has_a_card(page: Page, experiments: list[Experiment]) -> None:
    text = page.all_text
    cards = {a["id"] for a in page.find("article", "exp")}
    assert cards == {f"exp-{e.id}" for e in experiments}
    for e in experiments:
        assert e.id in text
    # The accepted path is marked; the others are evidence.
    on_path = {a["id"] for a in page.find("article", "on-path")}
    assert on_path == {"exp-e1", "exp-e2", "exp-e6"}
    assert {a["id"] for a in page.find("article", "failed")} == {"exp-e4"}
    rows = page.find("tr", "on-path")
    assert len(rows) == 3


def test_experiment_details(page: Page) -> None:
    text = " ".join(page.all_text.split())
    assert "a kernel question: the check tier covers model.lm_head in 0.4 s" in text  # planner reason
    assert "patch touches a protected path: infra-agent.yaml" in text  # the rejection
    assert "supported 1.185 [1.12, 1.25]" in text
    assert "95% paired bootstrap CI of the mean ratio over 3 runs" in text
    assert "kernel=lm_head variant=tp2 precision=bf16" in text  # locality
    # The rejected patch's diff is collapsed.
    details = [t for t, _ in page.tags if t == "details"]
    assert len(details) == 2  # e4 (rejected) and e6 (accepted) carry diffs
    # Findings: errors first, at most five, the rest counted.
    assert text.index("mismatch") < text.index("repeated_work") < text.index("lm_head at 0% of the memory roofline")
    assert "lm_head at 30% of the memory roofline" not in text
    assert "… and 1 more" in text
    assert "next: Is the split-K reduction order different from the reference?" in text


def test_accepted_diff_in_pre(page: Page, experiments: list[Experiment]) -> None:
    accepted = [e.change.diff for e in experiments if e.accepted and e.change.diff]
    assert len(accepted) == 1
    diff = accepted[0].rstrip("\n")
    # Under "Accepted changes", and collapsed in the experiment's card.
    assert page.pres.count(diff) == 2


def test_script_in_a_hypothesis_is_escaped(written: ReportPaths, page: Page) -> None:
    raw = written.html.read_text(encoding="utf-8")
    assert "<script" not in raw.lower()
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;" in raw
    assert "<script>alert('x')</script>" in page.all_text  # shown as text
    assert not page.find("script")


SECRET = "sk-live-4f9a2c7e1b8d"


def test_secret_from_the_environment_is_scrubbed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                 run: RunRecord, experiments: list[Experiment]) -> None:
    monkeypatch.setenv("INFRA_AGENT_API_KEY", SECRET)
    experiments[2].hypothesis.statement = f"Smaller prefill chunks help (token {SECRET})."
    experiments[2].change.description = f"curl -H 'x-api: {SECRET}'"
    experiments[4].feedback.findings[0].next_question = f"Retry with {SECRET}?"  # type: ignore[union-attr]
    paths = write_report(run, experiments, tmp_path)
    for p in paths:
        body = p.read_text(encoding="utf-8")
        assert SECRET not in body
        assert "(token ***)" in body


def test_numeric_knobs_named_like_secrets_stay_visible(tmp_path: Path, run: RunRecord,
                                                       experiments: list[Experiment]) -> None:
    experiments[1].change.knobs = {"max_batch_tokens": 1024, "hf_token": "hf_abcdefgh1234"}
    html = render_html(run, experiments)
    assert "max_batch_tokens=1024" in html
    assert "hf_abcdefgh1234" not in html and "hf_token=***" in html


def test_plot_points_and_axes(page: Page) -> None:
    svgs = page.find("svg", "plot")
    assert len(svgs) == 1
    # e1, e2, e3 and e6 measured output_throughput on chat; e4 never ran, e5 is a kernel check.
    points = page.find("circle", "pt")
    assert len(points) == 4
    assert len(page.find("circle", "pt-accepted")) == 3
    assert len(page.find("path", "best")) == 1
    assert len(page.find("line", "target")) == 1
    text = page.all_text
    assert "output_throughput [tok/s]" in text and "experiment (seq)" in text
    assert "criterion >= 300" in text
    # Tooltips give each point's experiment and value: the chat scenario's, not the long one's.
    assert "e1 (seq 1): 262.4 tok/s" in text and "e6 (seq 6): 318.2 tok/s" in text


def test_plot_points_lie_inside_the_axes(page: Page) -> None:
    svg = page.find("svg", "plot")[0]
    _, _, width, height = (float(v) for v in svg["viewbox"].split())
    for a in page.find("circle", "pt"):
        assert 0 < float(a["cx"]) < width and 0 < float(a["cy"]) < height
    # Higher throughput is drawn higher up: e6 (318) above e1 (262).
    cy = {a["cx"]: float(a["cy"]) for a in page.find("circle", "pt")}
    ordered = [cy[k] for k in sorted(cy, key=float)]
    assert ordered[-1] < ordered[0]


def test_no_data_gives_a_note(tmp_path: Path, run: RunRecord, experiments: list[Experiment]) -> None:
    for e in experiments:
        e.feedback = None
    page = Page(render_html(run, experiments))
    assert not page.find("svg", "plot")
    assert "No experiment's feedback has a measurement of output_throughput (scenario chat)" in page.all_text


def test_empty_run_renders(run: RunRecord) -> None:
    empty = run.model_copy(update={"gates_before": [], "gates_after": [], "best": None, "baseline": None})
    page = Page(render_html(empty, []))
    text = page.all_text
    assert "No gates were evaluated." in text
    assert "No experiments and no failing criterion" in text
    assert "No change was accepted" in text
