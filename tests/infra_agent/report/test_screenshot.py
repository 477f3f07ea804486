"""The HTML report rendered by a headless browser, where one is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from infra_agent.records import Experiment, RunRecord
from infra_agent.report import write_report

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.slow
@pytest.mark.skipif(BROWSER is None, reason="no chromium to render the report")
def test_headless_screenshot_is_not_blank(tmp_path: Path, run: RunRecord, experiments: list[Experiment]) -> None:
    paths = write_report(run, experiments, tmp_path / "report")
    png = tmp_path / "report.png"
    assert BROWSER is not None
    subprocess.run(
        [BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={png}", "--window-size=1280,2400",
         paths.html.resolve().as_uri()],
        check=True, capture_output=True, timeout=120,
    )
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    # A blank page of this size compresses to about 9 kB; the report is well over 100 kB.
    assert len(data) > 60_000
