"""Malformed, truncated, empty and wrongly shaped inputs: a clear error, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.errors import InfraAgentError
from infra_agent.trace.analyze import analyze
from infra_agent.trace.load import TraceLoadError, load_timeline

from .synth import case_b_spans, write


def test_truncated_json_names_file_and_byte(tmp_path: Path) -> None:
    text = json.dumps(case_b_spans())
    p = tmp_path / "cut.json"
    p.write_text(text[:200])
    with pytest.raises(TraceLoadError) as exc:
        load_timeline([p])
    msg = str(exc.value)
    assert str(p) in msg and "invalid JSON at byte 200" in msg and "truncated?" in msg
    assert isinstance(exc.value, InfraAgentError)


@pytest.mark.parametrize("content, expected", [
    ("", "empty file"),
    ('{"traceEvents": 3}', "expected Chrome trace JSON"),
    ('"hello"', "expected Chrome trace JSON"),
    ('{"traceEvents": [1]}', "traceEvents[0] is int"),
    ('{"traceEvents": [{"ph": "X", "name": "a", "ts": "soon", "dur": 1}]}', "expected a number for 'ts'"),
    ('{"traceEvents": [{"ph": "X", "name": "a", "ts": 1, "dur": null}]}', "expected a number for 'dur'"),
    (b"\xff\xfe", "not UTF-8 text at byte 0"),
])
def test_wrong_shapes(tmp_path: Path, content: str | bytes, expected: str) -> None:
    p = tmp_path / "bad.json"
    p.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(TraceLoadError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        load_timeline([p])


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceLoadError, match="cannot read trace"):
        load_timeline([tmp_path / "nope.json"])


def test_bad_pyspy_file(tmp_path: Path) -> None:
    spans = write(tmp_path / "t.json", case_b_spans())
    spy = write(tmp_path / "spy.json", [{"ph": "B", "cat": "py-spy", "tid": "x", "ts": 1}])
    with pytest.raises(TraceLoadError, match="expected an integer 'tid'"):
        load_timeline([spans], pyspy=spy)
    spy = write(tmp_path / "spy2.json", {"traceEvents": []})
    with pytest.raises(TraceLoadError, match="expected py-spy chrometrace output"):
        load_timeline([spans], pyspy=spy)


def test_empty_trace_analyses_to_nothing(tmp_path: Path) -> None:
    tl = load_timeline([write(tmp_path / "e.json", {"traceEvents": []})])
    report = analyze(tl)
    assert report.window == (0.0, 0.0) and report.threads == [] and report.overlap.note == "no spans"
    json.dumps(report.to_dict())


def test_unbalanced_begin_end(tmp_path: Path) -> None:
    doc = {"traceEvents": [{"ph": "B", "name": "a", "ts": 0, "pid": 1, "tid": 1},
                           {"ph": "E", "ts": 5, "pid": 1, "tid": 1}, {"ph": "E", "ts": 6, "pid": 1, "tid": 1},
                           {"ph": "B", "name": "open", "ts": 7, "pid": 1, "tid": 1},
                           {"ph": "i", "name": "mark", "ts": 9, "pid": 1, "tid": 1}]}
    tl = load_timeline([write(tmp_path / "u.json", doc)])
    assert sorted((s.name, s.start_us, s.end_us) for s in tl.spans) == [("a", 0, 5), ("open", 7, 9)]
    assert "1 'E' event(s) without a 'B', 1 'B' event(s) never closed" in tl.warnings[0]
