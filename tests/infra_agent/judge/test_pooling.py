"""Runs of one probe pooled into one Feedback: samples, run counts and each window's prompt set."""

from __future__ import annotations

from infra_agent.feedback import Feedback, Measurement, Tier
from infra_agent.judge.pooling import pool_runs


def _window(values: list[float], sets: list[int]) -> Feedback:
    return Feedback(probe="serving", tier=Tier.e2e,
                    measurements=[Measurement.from_samples("output_throughput", "tok/s", values, "higher",
                                                           component="client", scenario="chat")],
                    meta={"runs": len(values), "prompts": [{"scenario": "chat", "window": s, "seed": 7919 * s}
                                                           for s in sets]})


def test_every_runs_prompt_sets_and_samples_are_kept() -> None:
    pooled = pool_runs([_window([100.0, 101.0], [0, 1]), _window([99.0], [2]), Feedback(probe="serving", tier=Tier.e2e)])
    assert pooled is not None
    assert [p["window"] for p in pooled.meta["prompts"]] == [0, 1, 2]
    assert pooled.meta["runs"] == 4
    assert pooled.measurements[0].samples == [100.0, 101.0, 99.0]


def test_runs_without_prompt_sets_add_none() -> None:
    pooled = pool_runs([Feedback(probe="command", tier=Tier.check, meta={"runs": 1})] * 2)
    assert pooled is not None and "prompts" not in pooled.meta and pooled.meta["runs"] == 2
