"""The run report: one self-contained HTML file plus a Markdown summary.

``write_report(run, experiments, out_dir)`` writes ``report.html`` and ``report.md``;
``render_html`` and ``render_markdown`` return the text.  Both are laid out from one
view model (:mod:`infra_agent.report.model`) in which every string has been through
:func:`infra_agent.safety.scrub`.

The HTML has inline CSS and inline SVG plots, no scripts and no external resources, so
it opens offline and can be mailed or archived as one file.  The headline plot
(:mod:`infra_agent.report.ratio_plot`) draws what each verdict was decided on, each
experiment's paired ratio against its parent (:mod:`infra_agent.report.decisions`); each
card states the noise it was decided under (:mod:`infra_agent.report.noise`).  The
absolute metric over experiments (:mod:`infra_agent.report.plot`) is context at the end.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import NamedTuple

from infra_agent.records import Experiment, RunRecord
from infra_agent.report import html as _html
from infra_agent.report import markdown as _markdown
from infra_agent.report.model import ReportModel, build_model

__all__ = ["ReportModel", "ReportPaths", "build_model", "render_html", "render_markdown", "write_report"]

HTML_NAME = "report.html"
MARKDOWN_NAME = "report.md"


class ReportPaths(NamedTuple):
    html: Path
    markdown: Path


def render_html(run: RunRecord, experiments: list[Experiment]) -> str:
    return _html.render_html(run, experiments)


def render_markdown(run: RunRecord, experiments: list[Experiment]) -> str:
    return _markdown.render_markdown(run, experiments)


def _write(path: Path, text: str) -> None:
    """Write through a temporary file in the same folder, so a reader never sees half a report."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_report(run: RunRecord, experiments: list[Experiment], out_dir: Path) -> ReportPaths:
    """Write ``report.html`` and ``report.md`` into ``out_dir`` (created if missing)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_model(run, experiments)
    paths = ReportPaths(html=out / HTML_NAME, markdown=out / MARKDOWN_NAME)
    _write(paths.html, _html.render_model(model))
    _write(paths.markdown, _markdown.render_model(model))
    return paths
