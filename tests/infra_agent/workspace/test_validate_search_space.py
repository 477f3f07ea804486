"""`infra-agent validate` shows the search space: scale, typical range, machine bound, aliases
and constraints, in the table and in --json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from typer.testing import CliRunner

from infra_agent.cli.main import app

REPO = Path(__file__).resolve().parents[3]
runner = CliRunner()
CORES = len(os.sched_getaffinity(0))


def test_validate_shows_the_search_space() -> None:
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "vllm-serving")], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    for text in ("search", "log; typical [16, 1024]", "auto = bfloat16", f"machine {CORES} cores (os.sched_getaffinity",
                 "/proc/meminfo MemTotal", "constraints max_num_batched_tokens >= max_num_seqs"):
        assert text in result.stdout, text
    result = runner.invoke(app, ["validate", str(REPO / "examples" / "kv-transfer")], env={"COLUMNS": "240"})
    assert result.exit_code == 0, result.output
    assert f"<= {CORES // 2} (threads x 2 processes)" in result.stdout


def test_validate_json_has_the_search_space(write_ws, good: str) -> None:
    text = good.replace("components: [engine.scheduler]}",
                        "components: [engine.scheduler], typical: [4, 64]}\n"
                        "  threads: {type: int, min: 0, max: 1024, default: 1, resource: threads, per_process: 2}") \
        + "constraints: ['max_running >= threads']\nmachine: {cores: 8}\n"
    file = write_ws(text)
    result = runner.invoke(app, ["validate", str(file), "--json"])
    assert result.exit_code == 0, result.output
    space = json.loads(result.stdout)["search_space"]
    assert space["machine"]["cores"] == 8 and space["machine"]["cores_from"] == "machine.cores in infra-agent.yaml"
    assert space["knobs"]["max_running"] == {"scale": "log", "typical": [4, 64]}
    assert space["knobs"]["threads"] == {"scale": "linear", "resource": "threads", "per_process": 2, "bound": 4,
                                         "bound_from": "machine.cores in infra-agent.yaml"}
    assert space["constraints"] == [{"constraint": "max_running >= threads", "knobs": ["max_running", "threads"]}]
    data = json.loads(result.stdout)["workspace"]
    assert data["constraints"] == ["max_running >= threads"] and data["machine"] == {"cores": 8, "memory_gib": None}
