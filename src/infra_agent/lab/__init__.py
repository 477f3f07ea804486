"""The kernel lab: correctness against a reference and across partitionings,
microbenchmarks, a roofline measured in the same run, and work accounting.

Declare kernels with :mod:`infra_agent.lab.spec`; run them with
``infra-agent kernel check|bench SPEC`` or the ``kernel`` probe.
"""

from infra_agent.lab.spec import (
    DEFAULT_TOLERANCES,
    KernelSpec,
    Tolerance,
    Variant,
    kernel_spec,
    shape_label,
)

__all__ = ["DEFAULT_TOLERANCES", "KernelSpec", "Tolerance", "Variant", "kernel_spec", "shape_label"]
