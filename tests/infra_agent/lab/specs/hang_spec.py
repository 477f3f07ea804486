"""Kernels that never return or take their process down, between variants that work.

``sleeps`` starts a child process (a stand-in for a compiler or a helper a kernel
may spawn) and then sleeps far past any timeout; ``exits`` ends its process the way
a fault in an extension would.  With a timeout, the lab must record both, kill the
whole process group, and still check ``ok_before`` and ``ok_after``.  In
``hang_kernel`` the unpartitioned kernel itself hangs (its variant has no baseline
then), under the spec's own ``timeout_s``; in ``hang_reference`` the reference does,
which is the spec's fault.

When ``HANG_SPEC_PIDFILE`` is set, each call of a misbehaving variant appends the
pid of its process (and of the child it started) to that file, so tests can check
that nothing is left running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import torch

from infra_agent.lab.spec import KernelSpec, Tolerance, Variant


def _note_pid(pid: int) -> None:
    path = os.environ.get("HANG_SPEC_PIDFILE")
    if path:
        with open(path, "a") as f:
            f.write(f"{pid}\n")


def inputs(shape, dtype, seed, device):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(shape["N"], generator=g).to(device, dtype)}


def reference(x):
    return x.double() * 2


def good(x, *, precision="fp32"):
    return x * 2


def sleeps(x, *, precision="fp32"):
    _note_pid(os.getpid())
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    _note_pid(helper.pid)
    time.sleep(600)
    return x * 2


def slow_reference(x):
    time.sleep(600)
    return x.double() * 2


def exits(x, *, precision="fp32"):
    _note_pid(os.getpid())
    os._exit(3)


def _spec(name, kernel, variants, **kw):
    return KernelSpec(
        name=name,
        kernel=kernel,
        reference=kw.pop("reference", reference),
        inputs=inputs,
        shapes=[{"N": 16}],
        seeds=(1,),
        tolerances={"fp32": Tolerance(rtol=1e-6, atol=1e-6)},
        variants=variants,
        **kw,
    )


SPECS = [
    _spec("hang", good, [Variant("ok_before", good), Variant("sleeps", sleeps), Variant("exits", exits), Variant("ok_after", good)]),
    _spec("hang_kernel", sleeps, [Variant("ok_shard", good)], timeout_s=1.5),
    _spec("hang_reference", good, [], reference=slow_reference),
]
