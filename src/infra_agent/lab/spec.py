"""Declaring a kernel for the kernel lab: ``KernelSpec``, ``Variant``, ``Tolerance``.

A spec file is a plain Python file.  Every module-level ``KernelSpec`` (or a list or
tuple of them, or a zero-argument ``specs()`` function returning them) is a spec; the
loader collects them from the module's namespace, so loading twice never shares state.

Example (``matmul_spec.py``; the tests load this very text)::

    from __future__ import annotations
    import torch
    from infra_agent.lab.numerics import split_3xtf32, tf32_truncate
    from infra_agent.lab.spec import KernelSpec, Tolerance, Variant

    def inputs(shape, dtype, seed, device):
        g = torch.Generator().manual_seed(seed)
        a = torch.randn(shape["M"], shape["K"], generator=g)
        b = torch.randn(shape["K"], shape["N"], generator=g)
        return {"a": a.to(device, dtype), "b": b.to(device, dtype)}

    def matmul(a, b, *, precision="fp32"):      # kernels and variants get precision=
        if precision == "tf32":
            return tf32_truncate(a) @ tf32_truncate(b)
        if precision == "3xtf32":
            (ab, as_), (bb, bs) = split_3xtf32(a), split_3xtf32(b)
            return as_ @ bb + ab @ bs + ab @ bb
        return a @ b

    def split_k(a, b, *, precision="fp32", splits=4):
        ks = a.shape[1] // splits
        parts = [matmul(a[:, i * ks:(i + 1) * ks], b[i * ks:(i + 1) * ks], precision=precision)
                 for i in range(splits)]
        return torch.stack(parts).sum(0)

    def col_shard(a, b, *, precision="fp32"):   # TP column shards, gathered
        return torch.cat([matmul(a, bs, precision=precision) for bs in b.chunk(2, dim=1)], dim=1)

    SPEC = KernelSpec(
        name="matmul",
        kernel=matmul,
        reference=lambda a, b: a.double() @ b.double(),  # the truth; no precision kwarg
        inputs=inputs,
        shapes=[{"M": 64, "N": 48, "K": 256}],
        dtypes=(torch.float32,),
        precisions=("fp32", "tf32", "3xtf32"),
        tolerances={"tf32": Tolerance(rel_fro=2e-3)},     # others: DEFAULT_TOLERANCES
        variants=[
            Variant("split_k4", split_k, applies=lambda s: s["K"] % 4 == 0),
            Variant("col_shard2", col_shard, applies=lambda s: s["N"] % 2 == 0),
        ],
        # A partition sees the same rounded operands: only summation order differs.
        partition_tolerances={p: Tolerance(rel_fro=1e-6) for p in ("fp32", "tf32", "3xtf32")},
        flops=lambda s: 2 * s["M"] * s["N"] * s["K"],
        bytes_moved=lambda s, dt: (s["M"] * s["K"] + s["K"] * s["N"] + s["M"] * s["N"])
        * torch.empty((), dtype=dt).element_size(),
    )

Calling conventions (the lab relies on these):

- ``inputs(shape, dtype, seed, device) -> dict[str, Tensor]``; each callable below gets
  a fresh clone, so in-place kernels (a state updated in place) cannot corrupt the
  reference's inputs.
- ``kernel(**inputs, precision=mode)`` and ``variant.fn(**inputs, precision=mode)``
  return a tensor, a tuple/list of tensors, or a dict of tensors.
- Outputs are named ``out`` (one tensor), ``out0, out1, ...`` (a tuple) or by the
  dict's keys; each must have the reference's shape and the dtype ``out_dtypes``
  gives (the case's input dtype by default).
- ``outputs(result, inputs)`` (optional) picks what to compare after a kernel or
  variant call, from its result and the (cloned) inputs it was given.  An in-place
  kernel (a decode step that updates a state pool through slot indices) returns only
  its output, and ``outputs`` reads the updated rows out of ``inputs``; the gather
  then runs for the check but never inside the timed call.
- ``reference(**inputs)`` returns the same structure, computed however is most
  accurate (often float64); it is the truth for every precision mode.
- A variant is a partitioned form of the same computation (TP column/row/vocab
  shards, split-K, another tile size, chunked vs recurrent); it is compared with the
  unpartitioned ``kernel`` under the same precision mode.
- ``flops(shape)`` and ``bytes_moved(shape, dtype)`` count one call, for the roofline.
- ``work(**inputs, counter=counter)`` (spec or variant) runs the tiled kernel, or an
  instrumented model of its tiling, reporting into an
  ``infra_agent.lab.work.WorkCounter`` so repeated work across tiles is measured
  (often the kernel itself: ``work=partial(my_tiled_kernel, BV=32)``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from infra_agent.errors import KernelSpecError

Shape = Mapping[str, int]
InputFactory = Callable[[Shape, torch.dtype, int, str], dict[str, Any]]

# The variant name of the unpartitioned kernel itself (rows "kernel vs reference").
KERNEL = "kernel"

# Seconds one call (a kernel or variant with the comparison of its outputs, the input
# factory, the reference) may take in an isolated check before its worker is killed.
DEFAULT_TIMEOUT_S = 60.0

# ULP figures are taken over elements whose reference magnitude is at least this
# fraction of the reference's RMS.  An element near zero in a result with
# cancellation (a GEMM, a residual) carries the absolute error of the output's scale
# in a tiny ULP, so it shows millions of ULP while being as accurate as the rest.
DEFAULT_ULP_FLOOR = 1e-2

@dataclass(frozen=True)
class Tolerance:
    """Pass criteria; every criterion that is set must hold.

    ``atol``/``rtol`` are elementwise (``|x - ref| <= atol + rtol * |ref|``, like
    ``torch.allclose``); ``rel_fro`` bounds ``||x - ref||_F / ||ref||_F``, the figure
    that matters for GEMMs where single elements of the reference sit near zero;
    ``ulp`` bounds the ULP distance in the candidate's dtype, over the elements whose
    reference magnitude is at least ``ulp_floor`` times the reference's RMS (default
    ``DEFAULT_ULP_FLOOR``; 0 judges every element, right for elementwise kernels).
    """

    atol: float | None = None
    rtol: float | None = None
    rel_fro: float | None = None
    ulp: int | None = None
    ulp_floor: float | None = None

    def __post_init__(self) -> None:
        if self.atol is None and self.rtol is None and self.rel_fro is None and self.ulp is None:
            raise KernelSpecError("Tolerance: set at least one of atol, rtol, rel_fro, ulp")
        for name in ("atol", "rtol", "rel_fro", "ulp", "ulp_floor"):
            value = getattr(self, name)
            if value is not None and not value >= 0:
                raise KernelSpecError(f"Tolerance.{name}: expected a number >= 0, got {value!r}")

    @property
    def elementwise(self) -> bool:
        return self.atol is not None or self.rtol is not None

    @property
    def ulp_floor_rel(self) -> float:
        """The ULP floor as a fraction of the reference's RMS (the default when unset)."""
        return DEFAULT_ULP_FLOOR if self.ulp_floor is None else self.ulp_floor

    def describe(self) -> str:
        keys = ("atol", "rtol", "rel_fro", "ulp", "ulp_floor")
        parts = [f"{k}={getattr(self, k):g}" for k in keys if getattr(self, k) is not None]
        return " ".join(parts)


# Rough fallbacks, sized from the unit roundoff of each mode times a modest growth
# factor for reductions of a few thousand terms; a spec should override them when it
# knows its reduction length.
DEFAULT_TOLERANCES: dict[str, Tolerance] = {
    "fp64": Tolerance(rel_fro=1e-12),
    "fp32": Tolerance(rel_fro=1e-5),
    "3xtf32": Tolerance(rel_fro=1e-5),
    "tf32": Tolerance(rel_fro=3e-3),
    "bf16": Tolerance(rel_fro=2e-2),
    "fp16": Tolerance(rel_fro=3e-3),
}


class SpecSource:
    """Where a loaded spec came from, so that a worker process can load it again.

    ``callables`` and ``variants`` are the objects the file produced.  A spec derived
    with ``dataclasses.replace`` keeps its source; it can be rebuilt in another process
    only while its callables are still these objects (its data fields -- shapes,
    seeds, tolerances -- travel as they are).
    """

    __slots__ = ("callables", "digest", "name", "origin", "variants")

    def __init__(self, origin: str, name: str, digest: str, callables: dict[str, Any], variants: tuple[Variant, ...]) -> None:
        self.origin = origin
        self.name = name
        self.digest = digest
        self.callables = callables
        self.variants = variants

    def __repr__(self) -> str:
        return f"SpecSource({self.origin!r}, {self.name!r})"


# KernelSpec fields that hold code: a worker must find them in the spec file.
CALLABLE_FIELDS = ("kernel", "reference", "inputs", "flops", "bytes_moved", "work", "out_dtypes", "outputs")


@dataclass(frozen=True)
class Variant:
    """A partitioned form of the kernel, checked against the unpartitioned one."""

    name: str
    fn: Callable[..., Any]
    # Shapes this partitioning supports (e.g. K divisible by the split count).
    applies: Callable[[Shape], bool] | None = None
    # Per-precision override of the spec's partition tolerances.
    tolerances: Mapping[str, Tolerance] | None = None
    # Runs this variant's tiling with counter= (tile-size variants differ here).
    work: Callable[..., Any] | None = None
    gpu_only: bool = False
    description: str = ""

    def supports(self, shape: Shape) -> bool:
        return self.applies is None or bool(self.applies(shape))


@dataclass(frozen=True)
class KernelSpec:
    """Everything the lab needs to check, time and account for one kernel."""

    name: str
    kernel: Callable[..., Any]
    reference: Callable[..., Any] | None
    inputs: InputFactory
    shapes: Sequence[Shape]
    dtypes: Sequence[torch.dtype] = (torch.float32,)
    precisions: Sequence[str] = ("fp32",)
    tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    variants: Sequence[Variant] = ()
    # Tolerance of a variant against the unpartitioned kernel; it only has to cover
    # summation order, so it is usually tighter than the tolerance against the truth.
    partition_tolerances: Mapping[str, Tolerance] = field(default_factory=dict)
    gpu_only_precisions: Sequence[str] = ()
    gpu_only: bool = False
    flops: Callable[[Shape], float] | None = None
    bytes_moved: Callable[[Shape, torch.dtype], float] | None = None
    work: Callable[..., Any] | None = None
    # Expected output dtype(s) for (input dtype, precision): one dtype for every
    # output, or a dict by output name.  None: the input dtype of the case.
    out_dtypes: Callable[[torch.dtype, str], torch.dtype | Mapping[str, torch.dtype]] | None = None
    # outputs(result, inputs) -> the outputs to compare, picked after the call (not
    # timed); None: the call's result as is.  For kernels that update inputs in place.
    outputs: Callable[[Any, dict[str, Any]], Any] | None = None
    # Larger shapes for timing; the check shapes when None.
    bench_shapes: Sequence[Shape] | None = None
    # Seeds pinned for reproduction; None draws fresh seeds every run.
    seeds: Sequence[int] | None = None
    # Seconds one call may take in an isolated check (None: DEFAULT_TIMEOUT_S); a
    # spec with large shapes or a slow CPU reference raises it.
    timeout_s: float | None = None
    description: str = ""
    # Set by the loader: the file the spec came from, for error messages.
    origin: str = ""
    # Set by the loader: how a worker process loads this spec again (see SpecSource).
    source: SpecSource | None = field(default=None, repr=False, compare=False)

    def tolerance(self, precision: str) -> Tolerance:
        tol = self.tolerances.get(precision) or DEFAULT_TOLERANCES.get(precision)
        if tol is None:
            raise KernelSpecError(f"spec '{self.name}': no tolerance for precision '{precision}'")
        return tol

    def partition_tolerance(self, variant: Variant, precision: str) -> Tolerance:
        if variant.tolerances and precision in variant.tolerances:
            return variant.tolerances[precision]
        return self.partition_tolerances.get(precision) or self.tolerance(precision)

    def variant(self, name: str) -> Variant:
        for v in self.variants:
            if v.name == name:
                return v
        raise KernelSpecError(f"spec '{self.name}': no variant '{name}' (have {[v.name for v in self.variants]})")

    def problems(self) -> list[tuple[str, str]]:
        """What is wrong with the declaration, as (variant or field, problem) pairs."""
        out: list[tuple[str, str]] = []
        if not isinstance(self.name, str) or not self.name:
            out.append(("name", f"expected a non-empty string, got {self.name!r}"))
        if not callable(self.kernel):
            out.append(("kernel", f"expected a callable, got {self.kernel!r}"))
        if self.reference is None:
            out.append(("reference", "declares no reference; the lab needs the truth to check against"))
        elif not callable(self.reference):
            out.append(("reference", f"expected a callable, got {self.reference!r}"))
        if self.outputs is not None and not callable(self.outputs):
            out.append(("outputs", f"expected outputs(result, inputs), got {self.outputs!r}"))
        if not callable(self.inputs):
            out.append(("inputs", f"expected inputs(shape, dtype, seed, device), got {self.inputs!r}"))
        if not self.shapes:
            out.append(("shapes", "declares no shape cases"))
        for s in list(self.shapes) + list(self.bench_shapes or []):
            if not isinstance(s, Mapping) or not all(isinstance(v, int) for v in s.values()):
                out.append(("shapes", f"expected dicts of ints like {{'M': 64}}, got {s!r}"))
        if not self.dtypes or not all(isinstance(d, torch.dtype) for d in self.dtypes):
            out.append(("dtypes", f"expected torch dtypes, got {self.dtypes!r}"))
        for p in self.precisions:
            if p not in self.tolerances and p not in DEFAULT_TOLERANCES:
                out.append(("precisions", f"precision '{p}' needs a tolerance (known defaults: {list(DEFAULT_TOLERANCES)})"))
        if self.timeout_s is not None and not (isinstance(self.timeout_s, (int, float)) and self.timeout_s > 0):
            out.append(("timeout_s", f"expected seconds > 0, got {self.timeout_s!r}"))
        for p in self.gpu_only_precisions:
            if p not in self.precisions:
                out.append(("gpu_only_precisions", f"'{p}' is not among precisions {list(self.precisions)}"))
        seen: set[str] = set()
        for v in self.variants:
            if not isinstance(v, Variant):
                out.append(("variants", f"expected Variant(...), got {v!r}"))
                continue
            if v.name in seen:
                out.append((v.name, "variant name used twice"))
            seen.add(v.name)
            if not callable(v.fn):
                out.append((v.name, f"expected a callable, got {v.fn!r}"))
        return out


def kernel_spec(**fields: Any) -> Callable[[Callable[..., Any]], KernelSpec]:
    """Decorator form: ``@kernel_spec(reference=..., inputs=..., shapes=[...])`` on the kernel.

    The spec takes the function's name unless ``name=`` is given.
    """

    def wrap(fn: Callable[..., Any]) -> KernelSpec:
        rest = dict(fields)
        name = rest.pop("name", fn.__name__)
        return KernelSpec(name=name, kernel=fn, **rest)

    return wrap


def shape_label(shape: Shape) -> str:
    """``{"M": 64, "K": 256}`` -> ``"M=64,K=256"``: the ``input`` locality tag."""
    return ",".join(f"{k}={v}" for k, v in shape.items())
