"""The ledger masks by value, as every other channel does (issue #37, item 3).

A run's record, an experiment (its error, a finding's evidence, a server's log tail) and
the run's state carry secrets the way a failing server's output does: the environment's
key, the workspace target's ``SERVICE_TOKEN`` and the password of its ``DB_URL``, each
quoted bare, not under its name.  Every byte of the ledger's files is searched after.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import yaml

from infra_agent.feedback import Feedback, Finding, Tier
from infra_agent.ledger import Ledger
from infra_agent.records import Change, Experiment, Hypothesis, RunRecord
from infra_agent.safety import secret_name

ENV_KEY = "sk-test-FAKEledger0123456789"
SERVICE_TOKEN = "svc-FAKE-ledger-9a8b7c6d5e"
DB_PASSWORD = "pa55w0rdLedger"
SECRETS = (ENV_KEY, SERVICE_TOKEN, DB_PASSWORD)
# What a failing server printed, as a log tail quotes it: values without their names.
TAIL = (f"connecting to postgres://app:{DB_PASSWORD}@db:5432/prod\nretrying with {DB_PASSWORD}\n"
        f"auth header {SERVICE_TOKEN} refused\nclient key {ENV_KEY}\nper_token_ms=0.25 max_batch_tokens: 64\n")


@pytest.fixture(autouse=True)
def _only_these_secrets(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if secret_name(name):
            monkeypatch.delenv(name)
    monkeypatch.setenv("OPENAI_API_KEY", ENV_KEY)


def _workspace(root: Path) -> Path:
    root.mkdir(parents=True)
    spec = {"name": "ledger-secrets",
            "target": {"kind": "server", "command": [sys.executable, "-m", "http.server", "{port}"],
                       "env": {"DB_URL": f"postgres://app:{DB_PASSWORD}@db:5432/prod", "SERVICE_TOKEN": SERVICE_TOKEN}}}
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    return root


def test_every_byte_of_the_ledger_is_masked_by_value(tmp_path: Path) -> None:
    ws = _workspace(tmp_path / "ws")
    fb = Feedback(probe="serving", tier=Tier.e2e, ok=False, error=f"server exited before it was ready:\n{TAIL}",
                  findings=[Finding(kind="kernel_error", severity="error", message=f"log: {TAIL}",
                                    evidence={"log_tail": TAIL, SERVICE_TOKEN: "a key that is a secret"})])
    exp = Experiment(id="e1", run_id="r1", seq=1, status="error", role="experiment", error=f"launch failed: {TAIL}",
                     hypothesis=Hypothesis(statement=f"a fix for {DB_PASSWORD}", metric="output_throughput", direction="higher"),
                     change=Change(), feedback=fb)
    with Ledger.for_workspace(ws) as ledger:
        ledger.create_run(RunRecord(id="r1", workspace=str(ws), proposer="rules", started_at=time.time(),
                                    message=f"stopped: {TAIL}"))
        ledger.save_experiment(exp)
        ledger.set_state("r1", "notes", {"tail": TAIL, "url": f"postgres://app:{DB_PASSWORD}@db/prod"})
        # It reads back masked, with the names of metrics and knobs as written.
        back = ledger.get_run("r1")
        assert "***" in (back.message or "") and "per_token_ms=0.25 max_batch_tokens: 64" in (back.message or "")
    written = b"".join(p.read_bytes() for p in sorted((ws / ".infra-agent").rglob("*")) if p.is_file())
    assert written, "the ledger wrote nothing"
    found = {s: written.count(s.encode()) for s in SECRETS if s.encode() in written}
    assert found == {}, found
