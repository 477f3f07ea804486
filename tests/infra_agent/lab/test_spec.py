from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import torch

import infra_agent.lab.spec as spec_module
from infra_agent.errors import KernelSpecError
from infra_agent.lab.correctness import check_spec
from infra_agent.lab.loader import load_specs
from infra_agent.lab.spec import (
    DEFAULT_TOLERANCES,
    KernelSpec,
    Tolerance,
    Variant,
    kernel_spec,
    shape_label,
)


def test_docstring_example_loads_and_passes(tmp_path: Path) -> None:
    doc = spec_module.__doc__ or ""
    block = doc.split("::\n", 1)[1].split("\nCalling conventions", 1)[0]
    path = tmp_path / "matmul_spec.py"
    path.write_text(textwrap.dedent(block))
    (spec,) = load_specs(path)
    assert spec.name == "matmul" and spec.origin == str(path)
    report = check_spec(spec, n_seeds=1, device="cpu")
    assert report.passed, [r.to_dict() for r in report.failures]
    assert {r.variant for r in report.results} == {"kernel", "split_k4", "col_shard2"}


def test_tolerance_needs_a_criterion() -> None:
    with pytest.raises(KernelSpecError, match="at least one"):
        Tolerance()
    with pytest.raises(KernelSpecError, match="rtol"):
        Tolerance(rtol=-1.0)
    assert Tolerance(atol=1e-3, ulp=4).describe() == "atol=0.001 ulp=4"
    assert Tolerance(ulp=4, ulp_floor=0).describe() == "ulp=4 ulp_floor=0"
    with pytest.raises(KernelSpecError, match="ulp_floor"):
        Tolerance(ulp=4, ulp_floor=-1.0)


def _noop(x, *, precision="fp32"):  # type: ignore[no-untyped-def]
    return x


def test_tolerance_lookup_order() -> None:
    own = Tolerance(rel_fro=1e-4)
    part = Tolerance(rel_fro=1e-7)
    v_own = Variant("v1", _noop, tolerances={"tf32": Tolerance(atol=1.0)})
    spec = KernelSpec(
        name="t", kernel=_noop, reference=_noop, inputs=lambda s, d, seed, dev: {"x": torch.zeros(1)},
        shapes=[{"N": 1}], precisions=("fp32", "tf32"), tolerances={"fp32": own},
        variants=[v_own], partition_tolerances={"fp32": part},
    )
    assert spec.tolerance("fp32") is own and spec.tolerance("tf32") is DEFAULT_TOLERANCES["tf32"]
    assert spec.partition_tolerance(v_own, "fp32") is part
    assert spec.partition_tolerance(v_own, "tf32").atol == 1.0
    with pytest.raises(KernelSpecError, match="no tolerance for precision 'int4'"):
        spec.tolerance("int4")


def test_problems_and_decorator() -> None:
    @kernel_spec(reference=None, inputs=lambda s, d, seed, dev: {}, shapes=[], precisions=("fp8",),
                 variants=[Variant("a", _noop), Variant("a", _noop)])
    def my_kernel(x, *, precision="fp32"):  # type: ignore[no-untyped-def]
        return x

    assert my_kernel.name == "my_kernel" and my_kernel.kernel.__name__ == "my_kernel"
    fields = [f for f, _ in my_kernel.problems()]
    assert fields == ["reference", "shapes", "precisions", "a"]
    slow = KernelSpec(name="s", kernel=_noop, reference=_noop, inputs=lambda s, d, seed, dev: {}, shapes=[{"N": 1}], timeout_s=0)
    assert [f for f, _ in slow.problems()] == ["timeout_s"]
    assert shape_label({"M": 1, "K": 2}) == "M=1,K=2"
