"""Secrets never reach the ledger file: env-var values, Authorization headers, bearer tokens."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from infra_agent.feedback import Finding
from infra_agent.ledger import Ledger

SECRET = "sk-test-1234567890"
BEARER = "xyz123456789"


def _file_bytes(db: Path) -> bytes:
    # The WAL and shared-memory files hold recent pages too.
    return b"".join(p.read_bytes() for p in sorted(db.parent.glob(db.name + "*")))


def test_secrets_are_scrubbed_before_writing(tmp_path: Path, fx: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFRA_AGENT_API_KEY", SECRET)
    header = f"Authorization: Bearer {BEARER}"
    db = tmp_path / "ledger.db"
    led = Ledger(db)
    run = fx.make_run(options={"endpoint": "http://x", "note": f"key {SECRET}", "headers": [header]},
                      message=f"started with {SECRET}")
    led.create_run(run)
    exp = fx.make_experiment(seq=1)
    exp.hypothesis.statement = f"using {SECRET} with {header} is faster"
    exp.feedback.findings.append(Finding(kind="leak", message=f"saw {header}",
                                         evidence={"env": SECRET, "request": {"headers": header}},
                                         next_question=f"is {SECRET} needed?"))
    exp.feedback.measurements[0].tags["input"] = SECRET
    exp.feedback.artifacts[0].description = f"log with {header}"
    exp.error = f"failed: curl -H 'Authorization: Bearer {BEARER}'"
    led.save_experiment(exp)
    led.save_run(run)
    led.set_state(run.id, "conversation", [{"role": "user", "content": f"my key is {SECRET}, {header}"},
                                           {SECRET: "as a key"}])

    for raw in (_file_bytes(db), None):
        if raw is None:  # and again after close, when the WAL has been checkpointed
            led.close()
            raw = _file_bytes(db)
        assert raw
        assert SECRET.encode() not in raw
        assert BEARER.encode() not in raw

    with Ledger(db) as again:
        got = again.get_experiment(exp.id)
        assert SECRET not in got.model_dump_json() and BEARER not in got.model_dump_json()
        assert "***" in got.hypothesis.statement
        assert again.findings(exp.id)[-1].evidence["env"] == "***"
        assert SECRET not in str(again.get_state(run.id, "conversation"))
        assert "***" in again.get_run(run.id).options["note"]
