"""The example workspace against the real refstack: flags and domains agree, and it serves."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

from infra_agent.target import ServerProcess, group_members, open_target
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "refstack-serving"

pytestmark = pytest.mark.skipif(shutil.which("refstack") is None, reason="the refstack console script is not installed")


def test_example_knobs_match_refstack_domains() -> None:
    out = subprocess.run(["refstack", "knobs", "--json"], check=True, capture_output=True, text=True, timeout=60).stdout
    theirs = {k["name"]: k for k in json.loads(out)}
    ws = load_workspace(EXAMPLE)
    assert ws.knobs, "the example declares knobs"
    for name, knob in ws.knobs.items():
        ref = theirs[name]
        assert knob.type == ref["type"], name
        assert knob.default == ref["default"], name
        assert knob.components == ref["components"], name
        if knob.type == "choice":
            assert knob.choices == ref["domain"]["choices"], name
        else:
            assert (knob.min, knob.max) == (ref["domain"].get("min"), ref["domain"].get("max")), name
        assert f"{ref['flag']} {{{name}}}" in str(ws.target.command), f"{name} is passed as {ref['flag']}"


def test_example_launches_refstack_and_stops_it(tmp_path: Path, reap: list[int]) -> None:
    ws = load_workspace(EXAMPLE)
    with open_target(ws, ws.resolve_knobs({"max_running": "4"}), tmp_path) as target:
        assert isinstance(target, ServerProcess) and target.pgid is not None
        reap.append(target.pgid)
        assert "--max-running" in target.argv and target.argv[target.argv.index("--max-running") + 1] == "4"
        resp = httpx.post(
            target.url + "/v1/completions",
            json={"model": target.model, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
            trust_env=False,
            timeout=60,
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
        assert target.metrics_url is not None
        assert "refstack:" in httpx.get(target.metrics_url, trust_env=False, timeout=30).text
        target.check_alive()
    assert group_members(target.pgid) == []
