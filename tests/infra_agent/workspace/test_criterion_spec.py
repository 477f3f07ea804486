"""A criterion is parsed once, into the GateSpec every later layer reads."""

from __future__ import annotations

from infra_agent.records import GateSpec
from infra_agent.workspace.criteria import Criterion


def test_a_relative_criterion_is_a_ratio_gate_with_its_default_op() -> None:
    c = Criterion(name="tput", metric="output_throughput", scenario="chat", ratio=0.95)
    assert c.spec == GateSpec(kind="relative", metric="output_throughput", op=">=", threshold=0.95, scenario="chat")


def test_an_absolute_criterion_on_a_check_names_the_check() -> None:
    c = Criterion(name="kl", metric="kl_div", check="quality", value=0.01)
    assert c.spec == GateSpec(kind="absolute", metric="kl_div", op="<=", threshold=0.01, check="quality")
