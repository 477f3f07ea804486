"""Deterministic runs and experiments for the ledger tests (also imported by ledger_child.py)."""

from __future__ import annotations

from infra_agent.feedback import (
    Artifact,
    Feedback,
    Finding,
    Location,
    Measurement,
    Summary,
    Tier,
)
from infra_agent.records import (
    Change,
    Cost,
    Experiment,
    GateResult,
    Hypothesis,
    ProbeCall,
    RunRecord,
    Verdict,
)


def make_run(run_id: str = "run-1", started_at: float = 1000.0, **kw: object) -> RunRecord:
    fields: dict[str, object] = {"id": run_id, "workspace": "/tmp/ws", "proposer": "rules", "started_at": started_at,
                                 "options": {"pairs": 3, "budget": {"experiments": 10}}}
    fields.update(kw)
    return RunRecord.model_validate(fields)


def measurement(name: str, samples: list[float], **tags: str) -> Measurement:
    # A hand-made Summary keeps these tests free of the bootstrap (and of scipy's import time).
    s = sorted(samples)
    mid = s[len(s) // 2]
    summary = Summary(n=len(s), mean=sum(s) / len(s), median=mid, std=0.5, min=s[0], max=s[-1], p90=s[-1],
                      p99=s[-1], ci_low=s[0], ci_high=s[-1])
    return Measurement(name=name, unit="ms", samples=samples, summary=summary, better="lower", tags=tags)


def feedback(seed: int, n_measurements: int = 3, n_samples: int = 5) -> Feedback:
    ms = [measurement(f"m{i}", [float(seed + i + j) for j in range(n_samples)], kernel=f"k{i}")
          for i in range(n_measurements)]
    ms.append(Measurement(name="empty", unit="1", samples=[]))  # no summary: NULL columns
    return Feedback(
        probe="kernel-bench", tier=Tier.micro, scope=["kernel"], measurements=ms,
        findings=[
            Finding(kind="slow_kernel", message=f"k0 is slow (seed {seed})", severity="warning",
                    location=Location(file="model.py", line=42, kernel="k0", component="model.attention"),
                    evidence={"ratio": 1.5, "max_tokens": 512, "shape": [1, 2]}, next_question="why?"),
            Finding(kind="note", message="plain"),
        ],
        artifacts=[Artifact(kind="trace", path=f"traces/{seed}.json", description="timeline")],
        meta={"seed": seed},
    )


def make_experiment(run_id: str = "run-1", seq: int = 0, status: str = "done", with_feedback: bool = True,
                    wall_s: float = 2.0, probe: str | None = "kernel-bench", tier: Tier = Tier.micro,
                    n_measurements: int = 3, n_samples: int = 5, exp_id: str | None = None) -> Experiment:
    return Experiment.model_validate({
        "id": exp_id or f"{run_id}-e{seq}",
        "run_id": run_id,
        "seq": seq,
        "parent": None if seq == 0 else f"{run_id}-e{seq - 1}",
        "proposer": "rules",
        "hypothesis": Hypothesis(statement=f"raising max_num_seqs helps ({seq})", metric="output_throughput",
                                 direction="higher", min_effect=0.05, locality=Location(knob="max_num_seqs")),
        "change": Change(knobs={"max_num_seqs": 64 + seq, "max_num_batched_tokens": 8192, "eager": True},
                         diff="--- a/x.py\n+++ b/x.py\n@@ -1 +1 @@\n-a = 1\n+a = 2\n"),
        "probe": None if probe is None else ProbeCall(name=probe, tier=tier, config={"reps": 3}, reason="cheapest"),
        "status": status,
        "feedback": feedback(seq, n_measurements, n_samples) if with_feedback else None,
        "baseline_feedback": feedback(seq + 100, 1, n_samples) if with_feedback else None,
        "verdict": Verdict(outcome="supported", effect=1.2, low=1.1, high=1.3, accepted=seq % 2 == 1, gates=[
            GateResult(name="tput", gate="output_throughput>=1.05", kind="hypothesis", outcome="pass", value=1.2)]),
        "cost": Cost(wall_s=wall_s, tier=tier, probe_runs=2, llm_tokens=1234),
        "knobs": {"max_num_seqs": 64 + seq},
        "started_at": 1000.0 + seq,
        "finished_at": 1000.5 + seq if status != "running" else None,
    })
