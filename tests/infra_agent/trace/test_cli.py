"""`infra-agent trace analyze|diff` through a typer app built with the verb's register()."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from infra_agent.cli import trace as trace_cli
from infra_agent.cli.main import load_verb

from .synth import MAIN, ORIGIN_NS, case_b_pyspy, case_b_spans, ours, write


def _app() -> typer.Typer:
    app = typer.Typer()
    trace_cli.register(app)

    @app.callback()
    def _root() -> None:
        """root"""

    return app


def test_register_adds_one_command_named_trace() -> None:
    sub = typer.Typer()
    trace_cli.register(sub)
    assert list(typer.main.get_group(sub).commands) == ["trace"]
    assert (typer.main.get_group(sub).commands["trace"].help or "").startswith(trace_cli.HELP)


def test_analyze_human_and_json(tmp_path: Path) -> None:
    spans = write(tmp_path / "t.json", case_b_spans())
    spy = write(tmp_path / "spy.json", case_b_pyspy())
    merged = tmp_path / "merged.json"
    args = ["trace", "analyze", str(spans), "--pyspy", str(spy), "--pyspy-start-unix-ns", str(ORIGIN_NS),
            "--expect-overlap", "transfer:ep.dispatch|ep.combine", "--knob-hint", "moe.py=ep_release_gil"]
    res = CliRunner().invoke(_app(), [*args, "--merged", str(merged)])
    assert res.exit_code == 0, res.output
    assert "overlap (by cat)" in res.output and "kv_transfer@kv-transfer" in res.output
    assert "moe.py:42" in res.output and "gil_contention" in res.output
    assert any(e.get("cat") == "gil" for e in json.loads(merged.read_text())["traceEvents"])
    res = CliRunner().invoke(_app(), [*args, "--json"])
    out = json.loads(res.stdout)
    assert out["report"]["expected_overlap"][0]["both_us"] == 4000
    assert {f["kind"] for f in out["feedback"]["findings"]} >= {"gil_contention"}


def test_analyze_bad_file_is_a_clean_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"traceEvents": [')
    res = CliRunner().invoke(_app(), ["trace", "analyze", str(bad)])
    assert res.exit_code == 2 and res.exception is None or isinstance(res.exception, SystemExit)
    assert "invalid JSON at byte" in res.output and "Traceback" not in res.output


def test_diff(tmp_path: Path) -> None:
    a = write(tmp_path / "a.json", ours([("step", "e", MAIN, 0, 100, None), ("fwd", "m", MAIN, 10, 60, None)]))
    b = write(tmp_path / "b.json", ours([("step", "e", MAIN, 0, 160, None), ("fwd", "m", MAIN, 10, 60, None)]))
    res = CliRunner().invoke(_app(), ["trace", "diff", str(a), str(b), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["diff"]["e2e_delta_us"] == 60 and out["diff"]["spans"][0]["key"] == "step"
    assert out["findings"][0]["kind"] == "delta_attribution"
    res = CliRunner().invoke(_app(), ["trace", "diff", str(a), str(b)])
    assert "share of delta" in res.output


def test_load_verb_accepts_the_sub_app(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    cmd = load_verb("trace")
    assert sorted(cmd.commands) == ["analyze", "diff"]


def test_verb_module_stays_light() -> None:
    import subprocess
    import sys

    code = ("import sys, typer; from infra_agent.cli import trace; app = typer.Typer(); trace.register(app)\n"
            "from typer.testing import CliRunner; CliRunner().invoke(app, ['trace', 'analyze', '--help'])\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'numpy', 'scipy', 'torch', 'httpx'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_analyze_py_spy_dumps_alone_shows_every_threads_states(tmp_path: Path) -> None:
    """A server without spans: the dumps alone, as --pyspy or as the trace argument."""
    from .synth_dumps import SLEEP_LINE, app_file, asyncio_server, write_dumps

    app = app_file(tmp_path)
    dumps = write_dumps(tmp_path / "gil.jsonl", asyncio_server(app, blocking=True))
    res = CliRunner().invoke(_app(), ["trace", "analyze", "--pyspy", str(dumps)], env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "thread states (40 py-spy dumps)" in res.output and "event loop" in res.output
    assert f"time.sleep @ handle {app}:{SLEEP_LINE}" in res.output and "thread_blocked" in res.output
    res = CliRunner().invoke(_app(), ["trace", "analyze", str(dumps), "--json"])
    out = json.loads(res.stdout)
    loop = out["report"]["thread_states"]["threads"][0]
    assert loop["thread"] == "MainThread" and loop["role"] == "event loop" and loop["blocked_share"] > 0.5
    assert loop["sites"][0]["where"] == f"{app}:{SLEEP_LINE}"
    assert "thread_blocked" in {f["kind"] for f in out["feedback"]["findings"]}
    res = CliRunner().invoke(_app(), ["trace", "analyze"])
    assert res.exit_code == 2 and "--pyspy" in res.output
