"""The decisions plot and the noise each decision was made under, in HTML and Markdown."""

from __future__ import annotations

import math
import re
from html.parser import HTMLParser

import pytest

from infra_agent.records import Experiment, RunRecord
from infra_agent.report import build_model, render_html, render_markdown
from infra_agent.report.ratio_plot import y_ticks

RATIOS = {"e2": "accepted", "e3": "refuted", "e6": "accepted", "e7": "held", "e8": "inconclusive", "e10": "confirmed"}


class Svg(HTMLParser):
    """The decisions SVG: each decision group's child tags, and the tags outside any group."""

    def __init__(self, html: str) -> None:
        super().__init__(convert_charrefs=True)
        self.groups: dict[str, list[tuple[str, dict[str, str]]]] = {}
        self.outcomes: dict[str, str] = {}
        self.titles: dict[str, str] = {}
        self.other: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self._in_svg = False
        self._group: str | None = None
        self._in_title = False
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "svg":
            self._in_svg = "ratios" in a.get("class", "").split()
        if not self._in_svg:
            return
        if tag == "g" and "decision" in a.get("class", "").split():
            self._group = a["data-exp"]
            self.groups[self._group] = []
            self.outcomes[self._group] = a["data-outcome"]
        elif self._group is not None:
            self.groups[self._group].append((tag, a))
        else:
            self.other.append((tag, a))
        self._in_title = tag == "title"

    def handle_endtag(self, tag: str) -> None:
        if tag == "svg":
            self._in_svg = False
        elif tag == "g" and self._in_svg and self._group is not None:
            self._group = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        if not self._in_svg:
            return
        if self._in_title and self._group is not None:
            self.titles[self._group] = self.titles.get(self._group, "") + data
        self.text.append(data)

    def one(self, exp: str, tag: str, cls: str) -> dict[str, str]:
        (found,) = [a for t, a in self.groups[exp] if t == tag and cls in a.get("class", "").split()]
        return found

    def has(self, exp: str, cls: str) -> bool:
        return any(cls in a.get("class", "").split() for _, a in self.groups[exp])


@pytest.fixture
def svg(run: RunRecord, decided: list[Experiment]) -> Svg:
    return Svg(render_html(run, decided))


@pytest.fixture
def md(run: RunRecord, decided: list[Experiment]) -> str:
    return render_markdown(run, decided)


def test_one_error_bar_per_decided_ratio(svg: Svg) -> None:
    with_bar = {exp for exp in svg.groups if svg.has(exp, "ebar")}
    assert with_bar == set(RATIOS)
    for exp, outcome in RATIOS.items():
        assert svg.outcomes[exp] == outcome
        bar = svg.one(exp, "line", "ebar")
        assert bar["x1"] == bar["x2"]
        assert float(bar["y1"]) < float(bar["y2"])  # the high end is drawn above the low end
    # The baseline is no decision; the rejected patch and the timeout have no ratio; the count has its own row.
    assert "e1" not in svg.groups
    assert {exp: svg.outcomes[exp] for exp in ("e4", "e5", "e9")} == {"e4": "error", "e5": "inconclusive",
                                                                       "e9": "error"}


def test_a_higher_ratio_is_drawn_higher(svg: Svg, decided: list[Experiment]) -> None:
    by_id = {e.id: e for e in decided}

    def ratio(exp: str) -> tuple[float, float]:
        v = by_id[exp].verdict
        assert v is not None
        if v.effect is None:  # the confirmation: its ratio is its hypothesis gate's
            return v.gates[0].high or 0.0, v.gates[0].low or 0.0
        return v.high or 0.0, v.low or 0.0

    ends = {exp: (float(svg.one(exp, "line", "ebar")["y1"]), float(svg.one(exp, "line", "ebar")["y2"])) for exp in RATIOS}
    for a in RATIOS:
        for b in RATIOS:
            if ratio(a)[0] > ratio(b)[0]:
                assert ends[a][0] < ends[b][0], (a, b)
            if ratio(a)[1] > ratio(b)[1]:
                assert ends[a][1] < ends[b][1], (a, b)
    # Every column sits left to right by seq.
    xs = [float(svg.one(exp, "line", "ebar")["x1"]) for exp in sorted(RATIOS, key=lambda e: int(e[1:]))]
    assert xs == sorted(xs)


def test_the_line_each_hypothesis_needed(svg: Svg) -> None:
    (unity,) = [a for t, a in svg.other if t == "line" and "unity" in a.get("class", "")]
    one = float(unity["y1"])
    for exp in RATIOS:
        line, bar = svg.one(exp, "line", "threshold"), svg.one(exp, "line", "ebar")
        y, high, low = float(line["y1"]), float(bar["y1"]), float(bar["y2"])
        if exp == "e2":  # supported, needs >= 1.1: the whole interval above the line, the line above 1.0
            assert y > low and y < one
        if exp == "e3":  # refuted, needs >= 1.05: the whole interval below the line
            assert y < high
        if exp == "e8":  # lower is better, needs <= 0.952: the line below 1.0 and inside the interval
            assert one < y and high < y < low
        if exp == "e10":  # the confirmation needs no more than 1.0
            assert abs(y - one) < 0.2
        # The shaded side: above the line when higher is better, below it when lower is.
        zone = svg.one(exp, "rect", "zone")
        top, bottom = float(zone["y"]), float(zone["y"]) + float(zone["height"])
        assert (abs(top - y) < 0.2) == (exp == "e8") and (abs(bottom - y) < 0.2) == (exp != "e8")


def test_outcomes_differ_in_shape_not_only_colour(svg: Svg) -> None:
    def shape(exp: str) -> tuple[str, bool, str]:
        tag, a = next((t, a) for t, a in svg.groups[exp] if "marker" in a.get("class", "").split())
        return tag, a.get("fill") == "#ffffff", re.sub(r"[-\d.,\s]", "", a.get("d", ""))

    shapes = {outcome: shape(exp) for exp, outcome in {"e2": "accepted", "e3": "refuted", "e7": "held",
                                                        "e8": "inconclusive", "e9": "error", "e10": "confirmed"}.items()}
    assert len(set(shapes.values())) == len(shapes), shapes
    legend = " ".join(svg.text)
    for label in ("accepted", "supported, held back", "refuted", "inconclusive", "error / rejected (no ratio)",
                  "confirmation (best vs baseline)"):
        assert label in legend


def test_the_count_and_the_confirmation_are_drawn_their_own_way(svg: Svg) -> None:
    # failed_checks is decided as a count: in its own row, with its value, no bar and no line.
    assert not svg.has("e5", "ebar") and not svg.has("e5", "threshold")
    assert "failed_checks 2 (count; parent 4; difference in failed checks)" in svg.titles["e5"]
    assert "exact count" in svg.text and "no ratio" in svg.text and "2" in svg.text
    # The confirmation is labelled, and its ratio (against the baseline) comes from its hypothesis gate.
    assert any(a.get("class") == "confirm-label" for t, a in svg.other if t == "text")
    assert "confirm" in svg.text
    assert "output_throughput best / baseline 1.21 [1.17, 1.25]" in svg.titles["e10"]
    assert "the server did not answer within 600 s" in svg.titles["e9"]


def test_tooltips_say_what_was_decided_and_the_load(svg: Svg) -> None:
    assert svg.titles["e2"] == ("e2 (seq 2) accepted: output_throughput candidate / parent 1.185 [1.12, 1.25] "
                                "(95% paired bootstrap CI of the mean ratio over 3 runs); needs ≥ 1.1; "
                                "foreign CPU max 1.8 cores")
    assert "needs ≤ 0.9524" in svg.titles["e8"]


def test_html_cards_show_the_noise(run: RunRecord, decided: list[Experiment]) -> None:
    html = render_html(run, decided)

    def card(exp: str) -> str:
        body = html[html.index(f'id="exp-{exp}"'):]
        return " ".join(re.sub(r"<[^>]+>", " ", body[:body.index("</article>")]).split())

    e2 = card("e2")
    assert "interval width 0.13 (1.12 to 1.25, ±5.6%)" in e2
    assert ("foreign CPU max 1.8 cores, median 0.4 cores over 6 windows (3 candidate, 3 parent)" in e2)
    assert "load (1 min) max 3.5, median 2.3 over 6 windows (3 candidate, 3 parent)" in e2
    assert "foreign CPU max 3 cores, median 3 cores over 1 window load" in card("e3")
    assert "foreign CPU not recorded load (1 min) not recorded" in card("e6")
    assert "interval width none (an exact count)" in card("e5")
    assert "Noise" not in card("e4")  # rejected before it ran: nothing was measured


def test_markdown_decisions_and_noise(md: str) -> None:
    section = md[md.index("## Decisions"):md.index("## Experiment tree")]
    rows = [[c.strip() for c in line.strip("|").split(" | ")] for line in section.splitlines()
            if re.match(r"^\| \d+ \|", line)]
    assert [(r[1], r[3]) for r in rows] == [
        ("e2", "● accepted"), ("e3", "✕ refuted"), ("e4", "△ error / rejected (no ratio)"), ("e5", "○ inconclusive"),
        ("e6", "● accepted"), ("e7", "◆ supported, held back"), ("e8", "○ inconclusive"),
        ("e9", "△ error / rejected (no ratio)"), ("e10 confirm", "★ confirmation: confirmed")]
    e2 = rows[0]
    assert e2[4:7] == ["1.185×", "[1.12, 1.25]", "≥ 1.1"] and e2[8] == "foreign CPU max 1.8 cores"
    assert rows[3][4] == "2 (count; parent 4; difference in failed checks)" and rows[3][6] == "≤ baseline - 0"
    # The strip puts 1.0, the line and the point where the ratio axis does: e3 lies left of 1.0, its line right.
    strip = rows[1][7].strip("`")
    assert strip.index("✕") < strip.index("│") < strip.index("┆")
    e2_card = md[md.index("### e2 (#2"):md.index("### e3 (#3")]
    assert ("- **Noise:** interval width 0.13 (1.12 to 1.25, ±5.6%); foreign CPU max 1.8 cores, median 0.4 cores over "
            "6 windows (3 candidate, 3 parent); load (1 min) max 3.5, median 2.3 over 6 windows (3 candidate, 3 parent)"
            in e2_card)
    e8_card = md[md.index("### e8 (#8"):md.index("### e9 (#9")]
    assert "foreign CPU not recorded; load (1 min) not recorded" in e8_card


def test_nothing_decided_gives_a_note(run: RunRecord, decided: list[Experiment]) -> None:
    for e in decided:
        e.verdict = None
        e.status = "done"
    html, md = render_html(run, decided), render_markdown(run, decided)
    assert '<svg class="ratios"' not in html
    assert "No experiment has a verdict yet" in html and "No experiment has a verdict yet" in md


def test_the_model_skips_the_baseline_and_a_look_again(run: RunRecord, decided: list[Experiment]) -> None:
    look = decided[0].model_copy(update={"id": "e11", "seq": 11, "parent": "e6", "role": "diagnose"})
    m = build_model(run, [*decided, look])
    assert [d.id for d in m.decisions.items] == ["e2", "e3", "e4", "e5", "e6", "e7", "e8", "e9", "e10"]
    assert [d.id for d in m.decisions.counts] == ["e5"] and [d.id for d in m.decisions.unmeasured] == ["e4", "e9"]


def test_y_ticks_are_round_and_centred_on_one() -> None:
    assert y_ticks(math.log(1.29)) == [0.8, 0.9, 1.0, 1.1, 1.2]
    assert y_ticks(math.log(1.06)) == [0.96, 0.98, 1.0, 1.02, 1.04, 1.06]
    assert y_ticks(math.log(5)) == [0.25, 0.5, 1.0, 2.0, 4.0]


def test_only_a_count_decided_gives_a_short_labelled_panel(run: RunRecord, decided: list[Experiment]) -> None:
    svg = Svg(render_html(run, [decided[0], decided[4]]))
    assert list(svg.groups) == ["e5"] and not svg.has("e5", "ebar")
    assert "no experiment was decided on a ratio yet" in svg.text
