from __future__ import annotations

import sys
from pathlib import Path

import pytest

from infra_agent.errors import KernelSpecError
from infra_agent.lab.correctness import check_spec
from infra_agent.lab.loader import load_specs, select


def test_import_failure_names_file_and_line(specs_dir: Path) -> None:
    path = specs_dir / "broken" / "import_error_spec.py"
    with pytest.raises(KernelSpecError) as exc:
        load_specs(path)
    msg = str(exc.value)
    assert str(path) in msg and "line 7" in msg and "cannot build the kernel module" in msg


def test_missing_reference_names_spec(specs_dir: Path) -> None:
    with pytest.raises(KernelSpecError, match=r"no_reference_spec\.py: spec 'no_ref'.*declares no reference"):
        load_specs(specs_dir / "broken" / "no_reference_spec.py")


def test_throwing_input_factory_names_spec_and_factory(specs_dir: Path) -> None:
    with pytest.raises(KernelSpecError) as exc:
        load_specs(specs_dir / "broken" / "bad_factory_spec.py")
    msg = str(exc.value)
    assert "spec 'bad_factory', input factory: raised KeyError" in msg and "[N=4]" in msg
    assert "variant" not in msg


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
    with pytest.raises(KernelSpecError, match=r"matmul_spec\.py: spec 'matmul', input factory: raised ValueError: seed 13 unsupported \[shape=\[.*\] dtype=float32 seed=13") as exc:
        check_spec(flaky_spec, seeds=[13])
    assert "variant" not in str(exc.value)


def test_reference_failing_at_run_time_names_the_reference(specs_dir: Path) -> None:
    import dataclasses

    (spec,) = load_specs(specs_dir / "matmul_spec.py")

    def bad_reference(a, b):  # type: ignore[no-untyped-def]
        raise RuntimeError("no float64 on this backend")

    with pytest.raises(KernelSpecError, match=r"spec 'matmul', reference: raised RuntimeError: no float64 .*\[shape=\[M=.*seed=7 device=cpu\]") as exc:
        check_spec(dataclasses.replace(spec, reference=bad_reference), seeds=[7], device="cpu")
    assert "variant" not in str(exc.value)


def test_throwing_work_hook_names_hook_and_variant(specs_dir: Path) -> None:
    import dataclasses

    from infra_agent.lab.microbench import account_work
    from infra_agent.lab.spec import Variant

    (spec,) = load_specs(specs_dir / "matmul_spec.py")

    def broken(**_: object) -> None:
        raise KeyError("BV")

    with pytest.raises(KernelSpecError, match=r"spec 'matmul', work hook: raised KeyError"):
        account_work(dataclasses.replace(spec, work=broken))
    with pytest.raises(KernelSpecError, match=r"spec 'matmul', variant 'tiled', work hook: raised KeyError"):
        account_work(dataclasses.replace(spec, variants=[Variant("tiled", spec.kernel, work=broken)]))


def test_undeclared_precision_or_variant_raises_naming_spec_and_known(specs_dir: Path) -> None:
    (spec,) = load_specs(specs_dir / "matmul_spec.py")
    with pytest.raises(KernelSpecError, match=r"spec 'matmul': unknown precision 'fp64' \(declared: \['fp32', 'tf32', '3xtf32', 'bf16'\]\)"):
        check_spec(spec, seeds=[0], device="cpu", precisions=["fp64"])
    with pytest.raises(KernelSpecError, match=r"spec 'matmul': unknown variant 'split_k5' \(declared: \['kernel', 'split_k4'"):
        check_spec(spec, seeds=[0], device="cpu", variants=["split_k5"])
    # "kernel" names the unpartitioned kernel: no partition variant, not an error.
    only_kernel = check_spec(spec, seeds=[0], device="cpu", precisions=["fp32"], variants=["kernel"])
    assert only_kernel.checked > 0 and {r.variant for r in only_kernel.results} == {"kernel"}


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



def test_a_module_beside_the_spec_cannot_stand_in_for_an_installed_one(tmp_path: Path) -> None:
    # The audit's shadowing cheat without the executor's guard: a ``colorsys`` package beside
    # the spec must lose to the standard library's, while a plain helper there is still found.
    (tmp_path / "colorsys").mkdir()
    (tmp_path / "colorsys" / "__init__.py").write_text("SHADOWED = True\n")
    (tmp_path / "spec_helpers_for_loader_test.py").write_text("SCALE = 2.0\n")
    (tmp_path / "spec.py").write_text(
        "import colorsys\nimport torch\nfrom spec_helpers_for_loader_test import SCALE\n"
        "from infra_agent.lab.spec import KernelSpec\n"
        "assert not hasattr(colorsys, 'SHADOWED'), 'the spec folder shadowed an installed module'\n"
        "SPEC = KernelSpec(name='scale', inputs=lambda shape, dtype, seed, device: {'x': torch.ones(2)},\n"
        "                  reference=lambda x: x * SCALE, kernel=lambda x: x * SCALE, shapes=[{'n': 2}])\n")
    fresh = ("colorsys", "spec_helpers_for_loader_test")
    for name in fresh:  # imported from scratch, so sys.path order decides where from
        sys.modules.pop(name, None)
    try:
        (spec,) = load_specs(tmp_path / "spec.py")
    finally:
        for name in fresh:
            sys.modules.pop(name, None)
    assert spec.name == "scale" and str(tmp_path) not in sys.path
