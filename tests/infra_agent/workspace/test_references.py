"""The files a workspace file references are protected like the workspace file."""

from __future__ import annotations

from pathlib import Path

import yaml

from infra_agent.agent.executors.protect import matches
from infra_agent.workspace.loader import load_workspace
from infra_agent.workspace.references import referenced_files


def test_datasets_and_check_inputs_are_protected_but_not_a_commands_program(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "prompts.jsonl").write_text('{"prompt": "hi"}\n')
    (tmp_path / "golden.txt").write_text("42\n")
    (tmp_path / "run_check.py").write_text("print(1)\n")
    spec = {
        "target": {"kind": "endpoint", "url": "http://127.0.0.1:1"},
        "knobs": {"n": {"type": "int", "min": 1, "max": 4, "default": 1, "components": ["engine"]}},
        "scenarios": {"chat": {"dataset": {"kind": "jsonl", "path": "data/prompts.jsonl", "output_len": 4},
                               "endpoint": "chat", "num_requests": 1}},
        "checks": [{"name": "golden", "probe": "command", "config": {"command": ["python", "run_check.py"],
                                                                      "env": {"GOLDEN": "golden.txt", "N": "{n}"}}}],
    }
    (tmp_path / "infra-agent.yaml").write_text(yaml.safe_dump(spec))
    ws = load_workspace(tmp_path)
    assert referenced_files(ws) == ["data/prompts.jsonl", "golden.txt"]
    assert matches("data/prompts.jsonl", ws.protected_patterns) and matches("golden.txt", ws.protected_patterns)
    assert matches("run_check.py", ws.protected_patterns) is None
