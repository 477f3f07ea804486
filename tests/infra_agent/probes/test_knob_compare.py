"""The timeline probe's knob comparison, its arithmetic half: which values, the per-pair
ratios, the interval, the gate (the windows themselves run in test_case_b.py)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from infra_agent.errors import InfraAgentError
from infra_agent.feedback import Feedback, Tier
from infra_agent.probes.knob_compare import (
    fmt,
    pair_ratios,
    record_verdict,
    resolve_pair,
)
from infra_agent.workspace import load_workspace

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "kv-transfer" / "infra-agent.yaml"


def _ws(tmp_path: Path) -> Any:
    root = tmp_path / "kv-transfer"
    root.mkdir()
    (root / "infra-agent.yaml").write_text(EXAMPLE.read_text())
    return load_workspace(root)


def _fb() -> Feedback:
    return Feedback(probe="timeline", tier=Tier.trace, scope=["kv_transfer"])


def test_a_bool_knob_compares_false_with_true_and_knows_the_configurations_own_value(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    pair = resolve_pair(ws, "kv_transfer", None, {"kv_transfer": True}, "input_throughput", None)
    assert pair.values == (False, True) and pair.own is True and pair.ratio_name == "kv_transfer_ratio"
    assert pair.interval == "kv_transfer=true / kv_transfer=false" and pair.arm(0) == "kv_transfer=false"
    assert fmt(False) == "false" and fmt(4) == "4"


def test_an_undeclared_knob_or_a_pair_that_is_not_two_values_is_refused(tmp_path: Path) -> None:
    ws = _ws(tmp_path)
    with pytest.raises(InfraAgentError, match="'no_such_knob' is not a knob the workspace declares"):
        resolve_pair(ws, "no_such_knob", None, {}, "input_throughput", None)
    with pytest.raises(InfraAgentError, match="expected two values"):
        resolve_pair(ws, "kv_transfer", [True], {}, "input_throughput", None)
    numeric = next(name for name, k in ws.knobs.items() if k.type == "int")
    with pytest.raises(InfraAgentError, match="expected two values"):  # no default pair for a number
        resolve_pair(ws, numeric, None, {}, "input_throughput", None)
    assert resolve_pair(ws, "kv_transfer", [True, False], {}, "m", "r").values == (True, False)


def test_ratios_are_tested_over_reference_per_pair_and_a_pair_missing_the_metric_is_left_out() -> None:
    ref = [{"m": 100.0}, {"m": 50.0}, {"m": 80.0}, {"m": 0}]
    tested = [{"m": 90.0}, {"m": 55.0}, {}, {"m": 10.0}]
    assert pair_ratios(ref, tested, "m") == pytest.approx([0.9, 1.1])
    with pytest.raises(ValueError):  # the sides must have the same number of windows
        pair_ratios(ref, tested[:2], "m")


def test_the_verdict_is_the_geometric_mean_with_an_interval_and_gates_on_it(tmp_path: Path) -> None:
    pair = resolve_pair(_ws(tmp_path), "kv_transfer", None, {}, "input_throughput", None)
    passed = _fb()
    record_verdict(passed, pair, [0.98, 1.02, 1.0], "prefill", min_ratio=0.95)
    compare = passed.meta["compare"]
    assert passed.ok and passed.measurements[0].name == "kv_transfer_ratio"
    assert compare["geomean"] == pytest.approx(math.exp(sum(map(math.log, [0.98, 1.02, 1.0])) / 3))
    assert compare["low"] < compare["geomean"] < compare["high"]
    assert "3 interleaved pairs, scenario prefill" in compare["message"] and "gate_failed" not in passed.meta

    # The gate is decided on the interval, as the judge decides every ratio: wholly below 0.95 fails ...
    failed = _fb()
    record_verdict(failed, pair, [0.86, 0.85, 0.87], "prefill", min_ratio=0.95)
    assert not failed.ok and failed.meta["gate_failed"] == "kv_transfer_ratio"
    assert failed.error is not None and failed.error.startswith("kv_transfer_ratio 0.860 < 0.95: input_throughput with")
    assert failed.meta["gate"]["outcome"] == "fail" and failed.meta["gate"]["high"] < 0.95
    # ... an interval that straddles it is undecided (the run stays ok; the judge pools further runs) ...
    straddles = _fb()
    record_verdict(straddles, pair, [0.90, 0.97, 1.01], "prefill", min_ratio=0.95)
    assert straddles.ok and straddles.meta["gate"]["outcome"] == "inconclusive" and "gate_failed" not in straddles.meta
    assert straddles.meta["gate"]["more_samples"] is None or straddles.meta["gate"]["more_samples"] >= 1
    # ... and one pair has no interval: undecided, never a fail on a point estimate.
    one = _fb()
    record_verdict(one, pair, [0.86], "prefill", min_ratio=0.95)
    assert one.ok and one.meta["gate"]["outcome"] == "inconclusive"
    assert one.meta["compare"]["low"] == one.meta["compare"]["high"] == 0.86  # one pair: no interval

    with pytest.raises(InfraAgentError, match="no pair of windows measured 'input_throughput'"):
        record_verdict(_fb(), pair, [], "prefill", min_ratio=None)
    assert yaml.safe_load(EXAMPLE.read_text())["knobs"]["kv_transfer"]["type"] == "bool"
