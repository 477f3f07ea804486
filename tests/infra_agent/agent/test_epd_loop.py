"""The EPD case at the loop level, reduced: ``infra-agent run --proposer rules`` on
examples/epd.  The baseline serves a 1:1 image/text mix with images encoded inline on the
engine thread; its serving feedback must locate the text requests' wait at the encoder
(``encode_blocks_text`` at ``engine.encode``), and the first experiment must be the
playbook's answer to that finding, ``disagg: epd``, measured to a verdict.  Whether it is
accepted (text-only p99 TTFT at most 0.8x the baseline's) is printed, not asserted: a
loaded 2-core box shares its cores between the encode worker and the engines
(docs/performance.md, "EPD")."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.ledger import Ledger
from infra_agent.vocabulary import FindingKind

from .loop_workspace import git

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "epd" / "infra-agent.yaml"

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("PIL") is None, reason="refstack decodes images with Pillow")]


def _workspace(dest: Path) -> Path:
    spec = yaml.safe_load(EXAMPLE.read_text())
    spec["scenarios"]["mixed"].update(num_requests=24, max_concurrency=4)
    dest.mkdir(parents=True)
    (dest / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    (dest / ".gitignore").write_text(".infra-agent/\n")
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        git(dest, *args)
    return dest


def test_the_first_experiment_moves_the_encoder_off_the_engine_thread(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "epd")
    run = start_run(ws, RunOptions(proposer="rules", budget_runs=1, confirm=False, keep_going=True, top_up=False,
                                   probe_timeout_s=600), progress=False)
    with Ledger.for_workspace(ws) as ledger:
        exps = ledger.experiments(run.id)
    baseline = next(e for e in exps if e.role == "baseline")
    assert baseline.feedback is not None
    found = [f for f in baseline.feedback.findings if f.kind == FindingKind.ENCODE_BLOCKS_TEXT]
    assert found, [f"{f.kind}: {f.message}" for f in baseline.feedback.findings]
    assert found[0].location is not None and found[0].location.component == "engine.encode"
    first = next(e for e in exps if e.role == "experiment")
    assert first.change.knobs == {"disagg": "epd"}, (first.change, first.hypothesis.statement)
    assert "encodes" in first.hypothesis.statement and first.hypothesis.metric == "text_only_p99_ttft_ms"
    assert first.status == "done" and first.verdict is not None, (first.status, first.error)
    print(f"baseline: {found[0].message}; e1 {first.verdict.message}")
