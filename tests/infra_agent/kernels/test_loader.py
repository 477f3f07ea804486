from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra_agent.errors import KernelSpecError
from infra_agent.kernels.correctness import check_spec
from infra_agent.kernels.loader import load_specs, select


def test_import_failure_names_file_and_line(specs_dir: Path) -> None:
    path = specs_dir / "broken" / "import_error_spec.py"
    with pytest.raises(KernelSpecError) as exc:
        load_specs(path)
    msg = str(exc.value)
    assert str(path) in msg and "line 7" in msg and "cannot build the kernel module" in msg


def test_missing_reference_names_spec(specs_dir: Path) -> None:
    with pytest.raises(KernelSpecError, match=r"no_reference_spec\.py: spec 'no_ref'.*declares no reference"):
        load_specs(specs_dir / "broken" / "no_reference_spec.py")


def test_throwing_input_factory_names_spec_and_variant(specs_dir: Path) -> None:
    with pytest.raises(KernelSpecError) as exc:
        load_specs(specs_dir / "broken" / "bad_factory_spec.py")
    msg = str(exc.value)
    assert "spec 'bad_factory', variant 'inputs'" in msg and "KeyError" in msg and "[N=4]" in msg


def test_throwing_variant_predicate_names_variant(specs_dir: Path) -> None:
    with pytest.raises(KernelSpecError, match=r"spec 'bad_variant', variant 'split_k2': applies\(\) raised KeyError"):
        load_specs(specs_dir / "broken" / "bad_variant_spec.py")


def test_factory_failing_only_at_run_time_is_a_spec_error(specs_dir: Path) -> None:
    import dataclasses

    (spec,) = load_specs(specs_dir / "matmul_spec.py")

    def flaky(shape, dtype, seed, device):  # type: ignore[no-untyped-def]
        if seed == 13:
            raise ValueError("seed 13 unsupported")
        return spec.inputs(shape, dtype, seed, device)

    flaky_spec = dataclasses.replace(spec, inputs=flaky)
    assert check_spec(flaky_spec, seeds=[12], variants=[], precisions=["fp32"]).passed
    with pytest.raises(KernelSpecError, match=r"matmul_spec\.py: spec 'matmul', variant 'inputs'.*seed 13 unsupported.*seed=13"):
        check_spec(flaky_spec, seeds=[13])


def test_loads_are_independent_and_leave_no_module(specs_dir: Path) -> None:
    before = set(sys.modules)
    a = load_specs(specs_dir / "faulty_kernels_spec.py")
    b = load_specs(specs_dir / "faulty_kernels_spec.py")
    assert [s.name for s in a] == [s.name for s in b]
    assert a[0].kernel is not b[0].kernel  # two executions of the file
    assert not {m for m in set(sys.modules) - before if m.startswith("_infra_agent_kernel_spec")}
    assert str(specs_dir) not in sys.path


def test_select_unknown_name(specs_dir: Path) -> None:
    specs = load_specs(specs_dir / "faulty_kernels_spec.py")
    assert [s.name for s in select(specs, "nan")] == ["nan"]
    with pytest.raises(KernelSpecError, match="no spec named 'nope'"):
        select(specs, "nope")


def test_missing_file() -> None:
    with pytest.raises(KernelSpecError, match="no such spec file"):
        load_specs("/nonexistent/spec.py")
