"""The judge never shares a process or an import path with the code it judges (issue #37).

Each test builds a spec folder whose kernel lives in a module beside the spec
(``kernel_impl.py``) and whose reference uses another (``ref_impl.py``), then lets the
kernel module try a cheat that works when the kernel, the reference and the comparison
share a process: patching the comparison, finding the reference's output in memory,
sending the judge a pickle, slowing the clock, or (from a candidate tree) changing
the reference.  Each must come out as a failed check or an honest time.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import pytest

from infra_agent.lab.judge_files import judge_files, reachable_files
from infra_agent.lab.loader import load_specs
from infra_agent.lab.microbench import bench_spec
from infra_agent.lab.timing import time_cpu
from infra_agent.lab.worker import LabWorkers
from infra_agent.probes import ProbeContext
from infra_agent.probes.kernel import KernelProbe

# Module names carry a tag: the pytest process is the lab here and keeps what it imported.
SPEC = '''
import torch
from infra_agent.lab.spec import KernelSpec, Tolerance
from kernel_impl_TAG import mm
from ref_impl_TAG import ref


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape["M"], shape["K"], generator=g)
    b = torch.randn(shape["K"], shape["N"], generator=g)
    return {"a": a.to(device=device, dtype=dtype), "b": b.to(device=device, dtype=dtype)}


def reference(a, b):
    return ref(a, b)


SPEC = KernelSpec(name="mm", kernel=mm, reference=reference, inputs=inputs,
                  shapes=[{"M": 24, "K": 48, "N": 16}], precisions=("fp32",),
                  tolerances={"fp32": Tolerance(rel_fro=1e-5)}, seeds=[7], timeout_s=60,
                  bench_shapes=[{"M": 32, "K": 32, "N": 32}])
'''
REF = "def ref(a, b):\n    return a.double() @ b.double()\n"
HONEST = "def mm(a, b, *, precision='fp32'):\n    return a @ b\n"
WRONG = "def mm(a, b, *, precision='fp32'):\n    return a @ b + 0.01\n"

PATCH_COMPARE = WRONG + '''
import sys
from infra_agent.lab import numerics

_real = numerics.compare


def _always(out, ref, tol, cond):
    stats = _real(ref.to(out.dtype), ref, tol, cond)
    return stats


for _mod in list(sys.modules.values()):
    if getattr(_mod, "compare", None) is _real:
        _mod.compare = _always
'''

FIND_REFERENCE = '''
import gc
import torch


def mm(a, b, *, precision="fp32"):
    # Return a float64 tensor of the output's shape found in this process: the reference's.
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.dtype == torch.float64 and obj.shape == (a.shape[0], b.shape[1]):
            return obj.float()
    return torch.zeros(a.shape[0], b.shape[1])
'''

PICKLE_BOMB = '''
import gc
import os
import pickle
from multiprocessing.connection import Connection


class _Bomb:
    def __reduce__(self):
        return (os.mkdir, (os.environ["BOMB_DIR"],))


def mm(a, b, *, precision="fp32"):
    for obj in gc.get_objects():
        if isinstance(obj, Connection):
            obj.send_bytes(pickle.dumps(("out", {"out": _Bomb()})))
    return a @ b
'''

# Timed kernels do single-threaded work (a Python loop, ~1 ms) that dwarfs their small GEMM:
# a multi-threaded GEMM on a busy 2-core machine swings by orders of magnitude.
BUSY = '''
def mm(a, b, *, precision="fp32"):
    s = 0
    for i in range(20000):
        s += i
    return a @ b
'''

SLOW_CLOCK = BUSY + '''
import time

_ns, _s = time.perf_counter_ns, time.perf_counter
_t0_ns, _t0_s = _ns(), _s()
time.perf_counter_ns = lambda: _t0_ns + (_ns() - _t0_ns) // 10
time.perf_counter = lambda: _t0_s + (_s() - _t0_s) / 10
'''


_tags = itertools.count()


def spec_tree(root: Path, kernel: str, ref: str = REF, tag: str | None = None) -> Path:
    """A tree holding ``kernels/mm/spec.py`` and its two modules; trees that stand for two
    versions of one repository (pristine and candidate) share a ``tag``."""
    tag = tag or f"t{os.getpid()}_{next(_tags)}"
    folder = root / "kernels" / "mm"
    folder.mkdir(parents=True)
    (folder / "spec.py").write_text(SPEC.replace("TAG", tag))
    (folder / f"kernel_impl_{tag}.py").write_text(kernel)
    (folder / f"ref_impl_{tag}.py").write_text(ref)
    return folder / "spec.py"


def pristine_and_candidate(tmp_path: Path, kernel: str, ref: str = REF) -> tuple[Path, Path]:
    """The baseline's tree (the wrong kernel) and a candidate's that changes the kernel module."""
    tag = f"pc{os.getpid()}_{next(_tags)}"
    return spec_tree(tmp_path / "pristine", WRONG, tag=tag), spec_tree(tmp_path / "candidate", kernel, ref, tag=tag)


def check(spec_path: Path, tmp_path: Path, candidate: Path | None = None) -> dict:
    """The kernel probe as the executor runs it: from ``spec_path``'s tree, on the kernels
    of ``candidate``'s tree when given."""
    candidate_root = candidate.parents[2] if candidate is not None else None
    cwd = os.getcwd()
    os.chdir(spec_path.parents[2])  # the probe runs from its tree, as the executor starts it
    try:
        fb = KernelProbe().run({"spec": "kernels/mm/spec.py", "seeds": 1},
                               ProbeContext(workdir=tmp_path / "out", progress=False, candidate_root=candidate_root))
    finally:
        os.chdir(cwd)
    (report,) = json.loads(Path(fb.artifacts[0].path).read_text())
    return {"ok": fb.ok, "failed_checks": fb.meta["failed_checks"], "results": report["results"]}


def test_the_honest_kernel_passes_and_the_wrong_one_fails(tmp_path: Path) -> None:
    assert check(spec_tree(tmp_path / "honest", HONEST), tmp_path)["ok"]
    wrong = check(spec_tree(tmp_path / "wrong", WRONG), tmp_path)
    assert not wrong["ok"] and wrong["failed_checks"] == 1


def test_a_kernel_that_patches_the_comparison_still_fails(tmp_path: Path) -> None:
    # In the candidate's process the patch takes; the comparison runs in the lab's.
    pristine, candidate = pristine_and_candidate(tmp_path, PATCH_COMPARE)
    got = check(pristine, tmp_path, candidate)
    assert not got["ok"] and got["failed_checks"] == 1
    (row,) = got["results"]
    assert row["status"] == "failed" and row["stats"]["rel_fro"] > 1e-3


def test_a_kernel_that_returns_the_references_output_from_memory_fails(tmp_path: Path) -> None:
    # The reference ran in another process: there is no float64 result here to find.
    pristine, candidate = pristine_and_candidate(tmp_path, FIND_REFERENCE)
    got = check(pristine, tmp_path, candidate)
    assert not got["ok"] and got["failed_checks"] == 1


def test_a_reply_that_is_a_pickle_never_runs_in_the_judge(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bomb = tmp_path / "exploded"
    monkeypatch.setenv("BOMB_DIR", str(bomb))
    pristine, candidate = pristine_and_candidate(tmp_path, PICKLE_BOMB)
    got = check(pristine, tmp_path, candidate)
    assert not bomb.exists()  # nothing of the candidate's bytes ran here
    (row,) = got["results"]
    assert row["status"] == "failed" and row["fault"] == "crashed" and "cannot read" in row["message"]


def test_the_reference_and_its_helpers_come_from_the_pristine_tree(tmp_path: Path) -> None:
    # The candidate's tree changes the reference's helper to agree with its wrong kernel.
    shifted = "def ref(a, b):\n    return a.double() @ b.double() + 0.01\n"
    assert check(spec_tree(tmp_path / "alone", WRONG, shifted), tmp_path)["ok"]  # judged from its own tree, it agrees
    pristine, candidate = pristine_and_candidate(tmp_path, WRONG, shifted)
    judged = check(pristine, tmp_path, candidate)
    assert not judged["ok"] and judged["failed_checks"] == 1
    # ...while the kernel does come from the candidate's tree: an honest fix there passes.
    pristine, fixed = pristine_and_candidate(tmp_path / "fix", HONEST)
    assert check(pristine, tmp_path, fixed)["ok"]


def test_a_kernel_that_slows_the_clock_is_timed_by_the_judges(tmp_path: Path) -> None:
    # Never loaded here: the cheat would slow this process's clock.
    pristine, honest = pristine_and_candidate(tmp_path / "honest", BUSY)
    _, cheat = pristine_and_candidate(tmp_path / "cheat", SLOW_CLOCK)
    spec = load_specs(pristine)[0]
    medians: dict[str, list[float]] = {"honest": [], "cheat": []}
    for _ in range(3):  # interleaved: a busy machine slows both alike
        for name, tree in (("honest", honest), ("cheat", cheat)):
            with LabWorkers(spec, str(tree), tree.parents[2]) as workers:
                report = bench_spec(spec, device="cpu", n_seeds=1, budget_s=0.2, timeout_s=60, workers=workers)
            (entry,) = [e for e in report.entries if e.timing is not None]
            assert "judge's clock" in " ".join(entry.timing.notes)
            medians[name].append(entry.timing.median_s)
    ratio = statistics.median(medians["cheat"]) / statistics.median(medians["honest"])
    # The same work: a clock slowed 10x in the candidate's process would read ~0.1 here.
    assert ratio > 0.5, medians


def test_the_judges_clock_agrees_with_timing_in_process(tmp_path: Path) -> None:
    import torch

    spec = load_specs(spec_tree(tmp_path, BUSY))[0]
    inputs = spec.inputs({"M": 32, "K": 32, "N": 32}, torch.float32, 7, "cpu")
    here, there = [], []
    for _ in range(5):
        here.append(time_cpu(lambda: spec.kernel(**inputs), budget_s=0.2).median_s)
        (entry,) = [e for e in bench_spec(spec, device="cpu", n_seeds=1, budget_s=0.2, timeout_s=60).entries if e.timing]
        there.append(entry.timing.median_s)
    # The round trip is a few percent of a 5 ms batch; a loose bound holds on a busy machine.  Each
    # side's fastest round: other work only ever adds time, and the judge's path (a worker woken for
    # every batch) pays more for it; the medians of 3 rounds read 3.7x in one clean-clone suite run.
    assert 0.33 < min(there) / min(here) < 3.0, (here, there)


def test_the_judges_files_are_the_references_import_graph(tmp_path: Path) -> None:
    # The reference reaches ref_impl (imported by name); the kernel's module is not the judge's.
    path = spec_tree(tmp_path, HONEST)
    names = judge_files(load_specs(path), tmp_path)
    assert names[-1] == "kernels/mm/spec.py" and len(names) == 2 and names[0].startswith("kernels/mm/ref_impl_")
    # Through a module attribute, a closure and a partial, into a second helper.
    helpers = tmp_path / "helpers"
    helpers.mkdir()
    (helpers / "jf_deep.py").write_text("def exact(a, b):\n    return a.double() @ b.double()\n")
    (helpers / "jf_mid.py").write_text("import jf_deep\n\n\ndef via(a, b):\n    return jf_deep.exact(a, b)\n")
    (helpers / "jf_closure.py").write_text("from jf_deep import exact\n\n\ndef make():\n    inner = exact\n"
                                           "    return lambda a, b: inner(a, b)\n")
    sys.path.insert(0, str(helpers))
    try:
        import functools

        import jf_closure
        import jf_mid

        by_attribute = {p.name for p in reachable_files([functools.partial(jf_mid.via)], tmp_path)}
        assert by_attribute == {"jf_mid.py", "jf_deep.py"}, by_attribute
        by_closure = {p.name for p in reachable_files([jf_closure.make()], tmp_path)}
        assert by_closure == {"jf_closure.py", "jf_deep.py"}, by_closure
        # Code outside the tree (this test's own function) is not followed: it is not the candidate's.
        assert reachable_files([lambda a, b: jf_mid.via(a, b)], tmp_path) == set()
    finally:
        sys.path.remove(str(helpers))
