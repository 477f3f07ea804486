"""What the judge's clock must see (issue #37): the GPU clock's cross-check, and on a GPU the cheats it stops.

The CPU tests check the cross-check's rule itself (``judge_clock.gpu_clock_disagreement``)
and what the judge reads back from a candidate (``timed_inputs.read_kept``).  The GPU
tests (marked ``gpu``; skipped without CUDA) bench a float32 GEMM whose module either
patches ``torch.cuda.Event.elapsed_time`` to read a tenth, or runs the product on a side
stream the events do not wait for, each correct when checked: both must be refused by
the judge's own clock, and the honest kernel timed.  The CPU cheats (a thread, a
deferred output, a cache, a kernel right only when checked) are tried through the loop
in ``tests/infra_agent/security/cheats/test_kernel_timing.py``.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import pytest
import torch

from infra_agent.lab.judge_clock import GPU_CLOCK_BOUND, gpu_clock_disagreement
from infra_agent.lab.loader import load_specs
from infra_agent.lab.microbench import bench_spec
from infra_agent.lab.timed_inputs import pool_size, read_kept
from infra_agent.lab.wire import Garbled


# (events, judge, k): honest readings seen on an H100 (a 64^3, 512^3 and 2048^3 float32 GEMM).
@pytest.mark.parametrize(("events_us", "judge_us", "k"), [(7.17, 5.44, 280), (17.55, 17.60, 10), (17.42, 18.73, 10),
                                                          (346.0, 367.5, 1), (346.1, 387.1, 1), (100.0, 140.0, 1)])
def test_events_that_agree_with_the_judges_clock_stand(events_us: float, judge_us: float, k: int) -> None:
    # Warm back-to-back calls (the judge) may read less than cold events; a little more is noise.
    assert gpu_clock_disagreement(events_us * 1e-6, judge_us * 1e-6, k) is None


# Cheats seen on the same H100: elapsed_time reading a tenth, and the product on a side stream.
@pytest.mark.parametrize(("events_us", "judge_us", "k", "why"), [
    (0.71, 5.37, 280, "a tenth, on a 5 us kernel"), (34.84, 340.44, 1, "a tenth, on a 340 us kernel"),
    (2.03, 5.48, 682, "a side stream, on a 5 us kernel"), (1.89, 378.77, 1, "a side stream, on a 340 us kernel"),
    (40.0, 40.0 * GPU_CLOCK_BOUND + 1.0, 100, "just past the bound"),
])
def test_events_far_below_the_judges_clock_are_refused(events_us: float, judge_us: float, k: int, why: str) -> None:
    msg = gpu_clock_disagreement(events_us * 1e-6, judge_us * 1e-6, k)
    assert msg is not None and msg.startswith("refused:") and "judge's own clock" in msg, (why, msg)
    assert f"{events_us:.2f} µs" in msg and f"{judge_us:.2f} µs" in msg, msg


def test_the_pool_is_bounded_and_never_below_two() -> None:
    assert pool_size(1) == 2048 and pool_size(72 * 1024) == 910 and pool_size(2**30) == 2


def test_kept_outputs_are_read_field_by_field() -> None:
    good = [(0, {"out": torch.ones(2)}), (3, {"out": torch.zeros(2)})]
    assert [i for i, _ in read_kept([good], 4)] == [0, 3]
    for bad, why in (([(4, {"out": torch.ones(2)})], "pool input 4"), ([(0, {"out": 1.0})], "named tensors"),
                     ("outs", "list of (index, outputs)"), ([(0,)], "list of (index, outputs)")):
        with pytest.raises(Garbled, match=why.replace("(", r"\(").replace(")", r"\)")):
            read_kept([bad], 4)


SPEC = '''
import torch
from infra_agent.lab.spec import KernelSpec, Tolerance
from gpu_kernel_TAG import mm


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape["M"], shape["K"], generator=g)
    b = torch.randn(shape["K"], shape["N"], generator=g)
    return {"a": a.to(device=device, dtype=dtype), "b": b.to(device=device, dtype=dtype)}


def reference(a, b):
    return a.double() @ b.double()


SPEC = KernelSpec(name="mm", kernel=mm, reference=reference, inputs=inputs, shapes=[{"M": 64, "K": 64, "N": 64}],
                  precisions=("fp32",), tolerances={"fp32": Tolerance(rel_fro=1e-4)}, seeds=[3], timeout_s=120,
                  bench_shapes=[{"M": SIZE, "K": SIZE, "N": SIZE}])
'''
HONEST = "def mm(a, b, *, precision='fp32'):\n    return a @ b\n"
TENTH = '''
import torch

_elapsed = torch.cuda.Event.elapsed_time
torch.cuda.Event.elapsed_time = lambda self, end: _elapsed(self, end) / 10


def mm(a, b, *, precision="fp32"):
    return a @ b
'''
SIDE_STREAM = '''
import torch

_side = []


def mm(a, b, *, precision="fp32"):
    if not _side:
        _side.append(torch.cuda.Stream())
    _side[0].wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_side[0]):
        return a @ b
'''
_TAGS = itertools.count()


def _bench_entry(tmp_path: Path, kernel: str, size: int) -> dict:
    tag = f"{os.getpid()}_{next(_TAGS)}"
    folder = tmp_path / f"spec{tag}"
    folder.mkdir()
    (folder / "spec.py").write_text(SPEC.replace("TAG", tag).replace("SIZE", str(size)))
    (folder / f"gpu_kernel_{tag}.py").write_text(kernel)
    (spec,) = load_specs(folder / "spec.py")
    report = bench_spec(spec, device="cuda", budget_s=0.3, timeout_s=120)
    # Every cheat here is right when checked: the gate passes and the entry is timed (or refused while timed).
    assert all(not c.failures for c in report.checks), [r.message for c in report.checks for r in c.failures]
    (entry,) = [e for e in report.entries if e.variant == "kernel"]
    return entry.to_dict()


# A GEMM of about 5 us (launch-bound: the judge times hundreds of calls) and one of about 350 us.
SIZES = [64, 2048]


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES)
def test_the_honest_kernel_agrees_with_the_judges_clock(tmp_path: Path, size: int) -> None:
    entry = _bench_entry(tmp_path, HONEST, size)
    assert entry["status"] == "timed", entry
    notes = entry["timing"]["notes"]
    assert any("the judge's clock:" in n for n in notes), notes


@pytest.mark.gpu
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize(("name", "kernel"), [("elapsed_time reads a tenth", TENTH), ("a side stream", SIDE_STREAM)])
def test_a_gpu_clock_the_candidate_fools_is_refused(tmp_path: Path, name: str, kernel: str, size: int) -> None:
    entry = _bench_entry(tmp_path, kernel, size)
    assert entry["status"] == "failed" and entry["timing"] is None, (name, entry)
    assert "refused: the GPU clock in the candidate's worker" in entry["message"], (name, entry["message"])


if __name__ == "__main__":  # on a GPU machine without pytest: python -m tests...test_timed_calls
    sys.exit(pytest.main([__file__, "-q", "-m", "gpu"]))
