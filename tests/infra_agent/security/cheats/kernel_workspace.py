"""A workspace whose only gate is a CPU kernel check, and edits of its kernel module.

``kernels/mm/spec.py`` (the file the workspace references, so it is protected) checks a
float32 GEMM against a float64 ``a @ b`` on seeded inputs.  Its kernel is imported from
``kernels/mm/mm_kernel.py`` beside it, which nothing references: the candidate may edit
it.  The reference's arithmetic lives in ``kernels/mm/ref_helper.py``, also unreferenced
by the workspace file: the judge's own code, found by the reference's import graph.  The baseline kernel is deliberately wrong (``a @ b + 1e-2``), so the gate fails
there with one failed check.  The target is never launched: no scenario and no
criterion name it, so the baseline and every experiment run the check alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from infra_agent.agent.runner import RunOptions, start_run
from infra_agent.ledger import Ledger
from infra_agent.records import Experiment
from infra_agent.standin.server import serve_standin

from ...agent.loop_workspace import git
from .cheat_loop import Cheat, script

SPEC_PATH = "kernels/mm/spec.py"
KERNEL_PATH = "kernels/mm/mm_kernel.py"
REF_HELPER_PATH = "kernels/mm/ref_helper.py"
CHECK = "mm-gemm"
COMPONENT = "kernel.mm"
# Check shape: a [M, K] and b [K, N] in float32, the reference [M, N] in float64 (no
# input has the output's shape).  Bench shape: large enough for a timing above the clock.
CHECK_SHAPE = {"M": 16, "K": 32, "N": 12}
BENCH_SHAPE = {"M": 96, "K": 96, "N": 96}

SPEC = f'''\
"""A float32 GEMM against float64; the kernel comes from mm_kernel.py beside this file."""
from __future__ import annotations

import torch

from infra_agent.lab.spec import KernelSpec, Tolerance
from mm_kernel import mm
from ref_helper import exact


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(shape["M"], shape["K"], generator=g)
    b = torch.randn(shape["K"], shape["N"], generator=g)
    return {{"a": a.to(device, dtype), "b": b.to(device, dtype)}}


def reference(a, b):
    return exact(a, b)


# fp32 roundoff over K=32 terms is ~1e-7 relative; an offset of 1e-2 is far outside.
TIGHT = Tolerance(atol=1e-4, rtol=1e-4, rel_fro=1e-6)

SPEC = KernelSpec(
    name="mm",
    kernel=mm,
    reference=reference,
    inputs=inputs,
    shapes=[{CHECK_SHAPE!r}],
    bench_shapes=[{BENCH_SHAPE!r}],
    seeds=[0, 1],
    tolerances={{"fp32": TIGHT}},
    flops=lambda s: 2.0 * s["M"] * s["N"] * s["K"],
    bytes_moved=lambda s, dt: 4.0 * (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"]),
)
'''

REF_HELPER = '''\
"""The reference's arithmetic: float64 GEMM."""


def exact(a, b):
    return a.double() @ b.double()
'''

WRONG_KERNEL = '''\
"""The GEMM under test (the candidate may change this file)."""
import torch


def mm(a, b, *, precision="fp32"):
    # Deliberately wrong: every element is off by 1e-2.
    return a @ b + 1e-2
'''

RIGHT_KERNEL = '''\
"""The GEMM under test (the candidate may change this file)."""
import torch


def mm(a, b, *, precision="fp32"):
    return a @ b
'''


def replace_file(path: str, old: str, new: str) -> str:
    """A unified diff (git apply format) that replaces the whole text of ``path``."""
    assert old.endswith("\n") and new.endswith("\n"), "whole lines only"
    a, b = old.splitlines(), new.splitlines()
    body = "".join(f"-{line}\n" for line in a) + "".join(f"+{line}\n" for line in b)
    return f"diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -1,{len(a)} +1,{len(b)} @@\n{body}"


def edit_kernel(new_text: str, base: str = WRONG_KERNEL) -> str:
    """The diff that makes ``mm_kernel.py`` hold ``new_text``."""
    return replace_file(KERNEL_PATH, base, new_text)


def kernel_workspace(root: Path, *, kernel: str = WRONG_KERNEL) -> Path:
    """The workspace in ``root`` (a git repository), its kernel module holding ``kernel``."""
    (root / "kernels" / "mm").mkdir(parents=True)
    (root / SPEC_PATH).write_text(SPEC)
    (root / KERNEL_PATH).write_text(kernel)
    (root / REF_HELPER_PATH).write_text(REF_HELPER)
    (root / ".gitignore").write_text(".infra-agent/\n__pycache__/\n")
    spec: dict[str, Any] = {
        "name": "kernel-cheats",
        # Required by the workspace file, never launched: no scenario or criterion needs it.
        "target": {"kind": "server", "command": [sys.executable, "-c", "raise SystemExit(1)", "{port}"]},
        "checks": [{"name": CHECK, "probe": "kernel", "components": [COMPONENT],
                    "config": {"spec": SPEC_PATH, "seeds": 2, "device": "cpu"}}],
    }
    (root / "infra-agent.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    git(root, "init", "-q")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "kernel cheat workspace")
    return root


def kernel_cheat(name: str, text: str, *, metric: str = "failed_checks", direction: str = "lower",
                 min_effect: float = 1.0, base: str = WRONG_KERNEL) -> Cheat:
    """A cheat that is one edit of ``mm_kernel.py``, with the hypothesis it hopes to see supported."""
    return Cheat(name, metric, direction=direction, min_effect=min_effect, diff=edit_kernel(text, base),
                 component=COMPONENT)


@dataclass
class KernelRun:
    """One run of the loop on a kernel workspace: its baseline and its experiments, in order."""

    baseline: Experiment
    experiments: list[Experiment]

    def only(self) -> Experiment:
        assert len(self.experiments) == 1, [(e.id, e.status, e.error) for e in self.experiments]
        return self.experiments[0]


def run_cheats(root: Path, cheats: Sequence[Cheat], **options: Any) -> KernelRun:
    """Run the loop with the stand-in model proposing ``cheats`` (as ``try_cheats`` does), with
    ``options`` over the cheat tests' run options (``keep_going`` where the gate passes at the baseline)."""
    with serve_standin(script(list(cheats))) as url:
        opts = {"proposer": "llm", "model": "standin", "base_url": url, "budget_runs": len(cheats),
                "confirm": False, "top_up": False, "look_again": False, **options}
        run = start_run(root, RunOptions(**opts), progress=False)
    with Ledger.for_workspace(root) as ledger:
        exps = sorted(ledger.experiments(run.id), key=lambda e: e.seq)
    baseline = [e for e in exps if e.role == "baseline"]
    assert len(baseline) == 1 and baseline[0].status == "done", (run.status, run.message)
    return KernelRun(baseline[0], [e for e in exps if e.role == "experiment"])
