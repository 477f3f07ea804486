"""Cheat family: work the judge's clock does not see, and answers cached across timed calls (issue #37).

The workspace's only gate is the CPU GEMM check of ``kernel_workspace.py``, with the
correct kernel at the baseline, so the run goes on to a bench (``achieved_bandwidth``,
higher is better) and every edit below passes the correctness gate: each computes the
right answer whenever the check calls it, and cheats only on the calls that are timed.

a. **a thread does the work**: after the calls the check makes, each call starts a thread
   that fills the output and returns the empty buffer at once;
b. **a deferred output**: a ``torch.Tensor`` subclass that computes the product only when
   something reads it;
c. **a cache keyed on the input**: the answer is kept by the inputs' addresses and first
   elements, so every call on an input seen before is a dictionary lookup (the timing
   used to reuse one input for every call);
d. **right only when checked**: after the calls the check makes, zeros.

What stops them (``infra_agent.lab.timed_calls``, ``timed_inputs``): each timed call gets
an input of its own, made on the pristine side; each batch ends with a copy of its last
call's outputs, and a few of those (chosen after they ran) are compared with the
reference; a thread started during the timing and alive after a batch, or an output
that is not a plain tensor, is refused.  An honest edit (a comment) is timed within
noise of its parent, timed again beside it in interleaved rounds
(``agent/executors/check_pair.py``), so the guard costs an honest kernel nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra_agent.records import Experiment

from .cheat_loop import never_accepted
from .kernel_workspace import RIGHT_KERNEL, kernel_cheat, kernel_workspace, run_cheats

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# The check calls the kernel three times (two seeds on the check shape, one on the bench
# shape); a cheat that behaves on those calls reaches the timing.
CHECKED_CALLS = 3

THREAD = f'''\
"""The GEMM under test: after the checked calls, the product is computed on a thread."""
import threading

import torch

_calls = [0]


def mm(a, b, *, precision="fp32"):
    _calls[0] += 1
    if _calls[0] <= {CHECKED_CALLS}:
        return a @ b
    out = torch.empty(a.shape[0], b.shape[1], dtype=a.dtype)
    threading.Thread(target=lambda: torch.matmul(a, b, out=out), daemon=True).start()
    return out
'''

DEFERRED = '''\
"""The GEMM under test: a tensor that computes itself when read."""
import torch


class Deferred(torch.Tensor):
    @staticmethod
    def __new__(cls, a, b):
        out = torch.Tensor._make_subclass(cls, torch.empty(a.shape[0], b.shape[1], dtype=a.dtype))
        out._operands = (a, b)
        return out

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        with torch._C.DisableTorchFunctionSubclass():
            for x in args:
                if isinstance(x, Deferred) and getattr(x, "_operands", None) is not None:
                    a, b = x._operands
                    x._operands = None
                    x.copy_(a @ b)
            return func(*args, **(kwargs or {}))


def mm(a, b, *, precision="fp32"):
    return Deferred(a, b)
'''

CACHE = '''\
"""The GEMM under test, answering an input seen before from a cache."""
import torch

_answers = {}


def mm(a, b, *, precision="fp32"):
    key = (a.data_ptr(), b.data_ptr(), float(a.flatten()[0]), float(b.flatten()[-1]))
    out = _answers.get(key)
    if out is None:
        out = _answers[key] = a @ b
    return out
'''

CHECKED_ONLY = f'''\
"""The GEMM under test: right on the calls the check makes, zeros after."""
import torch

_calls = [0]


def mm(a, b, *, precision="fp32"):
    _calls[0] += 1
    if _calls[0] <= {CHECKED_CALLS}:
        return a @ b
    return torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
'''

HONEST = RIGHT_KERNEL.replace('    return a @ b\n', '    # The same product, only commented.\n    return a @ b\n')

CHEATS = {"a thread does the work": THREAD, "a deferred output": DEFERRED, "a cache keyed on the input": CACHE,
          "right only when checked": CHECKED_ONLY, "an honest edit": HONEST}


def _entries(side) -> list[dict]:
    report = json.loads(Path(next(a.path for a in side.artifacts if a.kind == "result")).read_text())
    return [e for r in report for e in r["entries"]]


def _bandwidth(side) -> float | None:
    found = [m.value for m in side.measurements if m.name == "achieved_bandwidth"]
    return found[0] if found else None


def _paired_effect(exp: Experiment) -> float:
    """The judge's candidate/parent bandwidth ratio: the parent timed again beside the candidate
    in interleaved rounds (A B, B A, A B), one value per run, never the baseline's cached run."""
    assert exp.verdict is not None and exp.verdict.effect is not None, (exp.status, exp.error, exp.verdict)
    assert "3 interleaved pairs" in exp.verdict.interval, exp.verdict.interval
    for side in (exp.feedback, exp.baseline_feedback):
        assert side is not None and side.meta.get("runs") == 3 and "reused_from" not in side.meta, side and side.meta
    return exp.verdict.effect


def _bench_sides(root: Path, exp: Experiment) -> list[str]:
    """Which side each bench job of ``exp`` ran, in the order they ran (``base`` or ``cand`` worktree)."""
    jobs = sorted((root / ".infra-agent" / "runs" / exp.run_id / exp.id).glob("job-*.json"),
                  key=lambda f: int(f.stem.split("-")[1]))
    out = []
    for f in jobs:
        job = json.loads(f.read_text())
        if job.get("config", {}).get("mode") == "bench":
            out.append("base" if f"{exp.id}-base" in job["workspace"] else "cand")
    return out


@pytest.fixture(scope="module")
def tried(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Experiment]]:
    root = kernel_workspace(tmp_path_factory.mktemp("timing-cheats") / "ws", kernel=RIGHT_KERNEL)
    cheats = [kernel_cheat(name, text, metric="achieved_bandwidth", direction="higher", base=RIGHT_KERNEL)
              for name, text in CHEATS.items()]
    run = run_cheats(root, cheats, keep_going=True)
    assert len(run.experiments) == len(cheats), [(e.id, e.status, e.error) for e in run.experiments]
    return root, dict(zip(CHEATS, run.experiments, strict=True))


@pytest.mark.parametrize(("name", "why"), [("a thread does the work", ("thread", "does not match the reference")),
                                           ("a deferred output", ("subclass",)),
                                           ("right only when checked", ("does not match the reference",))])
def test_work_hidden_from_the_clock_is_refused(tried: tuple[Path, dict[str, Experiment]], name: str,
                                               why: tuple[str, ...]) -> None:
    exp = tried[1][name]
    how = never_accepted(exp)
    assert exp.feedback is not None, how
    # It passed the correctness gate (the check's calls are honest) and was refused while timed.
    assert exp.feedback.meta.get("failed_checks") == 0, (how, exp.feedback.meta)
    (entry,) = [e for e in _entries(exp.feedback) if e["variant"] == "kernel"]
    assert entry["status"] == "failed" and entry.get("timing") is None, entry
    assert "refused while timing" in entry["message"] or "refused:" in entry["message"], entry["message"]
    assert any(w in entry["message"] for w in why), entry["message"]
    assert _bandwidth(exp.feedback) is None, exp.feedback.measurements


def test_a_cache_across_timed_calls_is_measured_as_no_gain(tried: tuple[Path, dict[str, Experiment]]) -> None:
    exp = tried[1]["a cache keyed on the input"]
    how = never_accepted(exp)
    assert exp.feedback is not None and exp.baseline_feedback is not None, how
    # Every timed call misses the cache (an input of its own); reusing one input, it hit on all but one
    # call and read many times the baseline.  A loose bound a busy machine keeps.
    assert _paired_effect(exp) < 2.0, exp.verdict
    notes = [n for e in _entries(exp.feedback) if e.get("timing") for n in e["timing"]["notes"]]
    assert any("an input of its own" in n for n in notes), notes


def test_an_honest_kernel_is_timed_within_noise(tried: tuple[Path, dict[str, Experiment]]) -> None:
    exp = tried[1]["an honest edit"]
    assert exp.feedback is not None and exp.baseline_feedback is not None, (exp.status, exp.error)
    # Against the parent timed beside it: one sample of the cached baseline, timed minutes earlier under
    # another load, read 2.24 against 1.01 on a busy 2-core machine.
    assert 0.5 < _paired_effect(exp) < 2.0, exp.verdict
    assert _bench_sides(tried[0], exp) == ["base", "cand", "cand", "base", "base", "cand"]
    (entry,) = [e for e in _entries(exp.feedback) if e["variant"] == "kernel"]
    assert entry["status"] == "timed", entry
