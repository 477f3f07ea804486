"""Error metrics between a result and a reference: max abs, max rel, ULP, relative
Frobenius, with the worst element's index and the input condition that produced it.

ULP distances come from integer views of the bit patterns, so they are exact and
dtype-aware (fp64/fp32/bf16/fp16): ``ulp_distance(x, nextafter(x, inf)) == 1``.
The reported max ULP (and the ``ulp`` criterion) covers only elements whose reference
magnitude is at least ``Tolerance.ulp_floor`` times the reference's RMS: near zero a
tiny ULP turns an ordinary absolute error into millions of ULP.
``tf32_truncate`` emulates TF32 inputs on any device, for tolerance reasoning and tests.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from infra_agent.lab.spec import Tolerance

# Sign-magnitude masks and the integer view of each float dtype.
_INT_VIEW: dict[torch.dtype, tuple[torch.dtype, int]] = {
    torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF),
    torch.float32: (torch.int32, 0x7FFFFFFF),
    torch.bfloat16: (torch.int16, 0x7FFF),
    torch.float16: (torch.int16, 0x7FFF),
}
# Sign, 8 exponent bits, top 10 mantissa bits: 0xFFFFE000 as a signed int32.
TF32_MASK = -8192


@contextmanager
def ieee_fp32() -> Iterator[None]:
    """True fp32 GEMMs inside the block, whatever the process allows.

    On CUDA a plain fp32 ``a @ b`` becomes a TF32 product when the process allows it
    (``torch.set_float32_matmul_precision("high")``, ``allow_tf32``, or
    ``TORCH_ALLOW_TF32_CUBLAS_OVERRIDE``), so a kernel that means IEEE fp32 says so.
    """
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(prev)


def tf32_truncate(x: torch.Tensor) -> torch.Tensor:
    """Round fp32 values toward zero to TF32 (10 explicit mantissa bits).

    Truncation, not round-to-nearest: it is how the 3xTF32 split is defined and it
    bounds the hardware's error from above (unit roundoff 2**-10 instead of 2**-11).
    """
    x32 = x.to(torch.float32).contiguous()
    return (x32.view(torch.int32) & TF32_MASK).view(torch.float32)


def split_3xtf32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``big = tf32(x)``, ``small = tf32(x - big)``; big + small carries ~21 bits of x."""
    big = tf32_truncate(x)
    return big, tf32_truncate(x.to(torch.float32) - big)


def _sign_magnitude(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(negative?, magnitude bits) of each element; float bits are sign-magnitude integers."""
    int_dtype, mag_mask = _INT_VIEW[x.dtype]
    bits = x.contiguous().view(int_dtype)
    return bits < 0, (bits & mag_mask).to(torch.int64)


def ulp_distance(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """ULPs between ``x`` and ``ref`` rounded to ``x``'s dtype; inf where either is not finite.

    Within one sign the distance is the difference of the magnitude bits; across zero
    it is the sum of both magnitudes (+0 and -0 are 0 apart).  Exact in int64, except
    the cross-zero sum for fp64, which may exceed int64 and is taken in float64.
    """
    if x.dtype not in _INT_VIEW:
        raise TypeError(f"ULP distance needs a float dtype in {list(_INT_VIEW)}, got {x.dtype}")
    r = ref.to(x.dtype)
    neg_x, mag_x = _sign_magnitude(x)
    neg_r, mag_r = _sign_magnitude(r)
    same_side = (neg_x == neg_r) | (mag_x == 0) | (mag_r == 0)
    within = (mag_x - mag_r).abs().to(torch.float64)
    across = mag_x.to(torch.float64) + mag_r.to(torch.float64)
    if x.dtype != torch.float64:
        across = (mag_x + mag_r).to(torch.float64)  # exact: both are below 2**31
    dist = torch.where(same_side, within, across)
    finite = torch.isfinite(x) & torch.isfinite(r)
    # Two equal infinities are 0 ULP apart; anything else non-finite is unbounded.
    same_inf = torch.isinf(x) & (x == r)
    return torch.where(finite | same_inf, torch.where(same_inf, 0.0, dist), math.inf)


@dataclass(frozen=True)
class Condition:
    """The input condition a result came from: enough to reproduce it."""

    spec: str
    variant: str
    shape: str
    dtype: str
    seed: int
    precision: str
    device: str
    output: str = "out"

    def label(self) -> str:
        return (
            f"spec={self.spec} variant={self.variant} output={self.output} shape=[{self.shape}] "
            f"dtype={self.dtype} seed={self.seed} precision={self.precision} device={self.device}"
        )


@dataclass
class ErrorStats:
    max_abs: float
    max_rel: float
    max_ulp: float
    rel_fro: float
    # Index of the element that most exceeds the tolerance (largest abs error when
    # the tolerance is not elementwise), with the two values there.
    worst_index: tuple[int, ...]
    worst_value: float
    worst_ref: float
    n_elements: int
    n_nonfinite: int = 0
    # Elements past an elementwise criterion (atol/rtol, ulp) or non-finite.  rel_fro
    # is a norm over the whole tensor and marks no element, so a result failing only
    # rel_fro has 0 here: ``violated`` says which criteria failed.
    n_violations: int = 0
    passed: bool = True
    reason: str = ""
    # Failed criteria, in order: "nonfinite", "atol/rtol", "ulp", "rel_fro".
    violated: list[str] = field(default_factory=list)
    condition: Condition | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # ``max_ulp`` is over elements with |ref| >= ulp_floor (an absolute magnitude:
    # the tolerance's relative floor times the reference's RMS); ``max_ulp_all`` is
    # over every element, huge wherever a reference sits at or across zero.
    max_ulp_all: float = 0.0
    ulp_floor: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["worst_index"] = list(self.worst_index)
        return d


def _unravel(flat: int, shape: torch.Size) -> tuple[int, ...]:
    idx = []
    for dim in reversed(shape):
        idx.append(flat % dim)
        flat //= dim
    return tuple(reversed(idx))


def compare(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance, condition: Condition | None = None) -> ErrorStats:
    """Errors of ``out`` against ``ref`` and whether ``tol`` holds.

    Shapes must already match.  Max rel is taken over elements whose reference is
    non-zero (a zero reference has no relative error to speak of; its abs error still
    counts).  Non-finite outputs fail regardless of tolerance unless the reference
    has the same non-finite value there.
    """
    assert out.shape == ref.shape, f"compare() needs equal shapes, got {tuple(out.shape)} vs {tuple(ref.shape)}"
    x = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    n = x.numel()
    if n == 0:
        return ErrorStats(0.0, 0.0, 0.0, 0.0, (), 0.0, 0.0, 0, condition=condition)

    e = _ElementErrors.of(out, ref, x, r, tol)
    max_ulp = float(torch.where(e.ulp_counted, e.ulp, 0.0).max())
    violation, score = _violations(e, tol)
    flat = int(torch.argmax(torch.where(e.nonfinite, math.inf, score).reshape(-1)))
    n_nonfinite = int(e.nonfinite.sum())
    n_viol = int(violation.sum())
    reasons, violated = _failed_criteria(tol, n_nonfinite, n_viol, max_ulp, e.ulp_floor, e.rel_fro)
    return ErrorStats(
        max_abs=float(e.diff.max()),
        max_rel=float(e.rel.max()),
        max_ulp=max_ulp,
        rel_fro=e.rel_fro,
        worst_index=_unravel(flat, x.shape),
        worst_value=float(x.reshape(-1)[flat]),
        worst_ref=float(r.reshape(-1)[flat]),
        n_elements=n,
        n_nonfinite=n_nonfinite,
        n_violations=n_viol,
        passed=not reasons,
        reason="; ".join(reasons),
        violated=violated,
        condition=condition,
        max_ulp_all=float(e.ulp.max()),
        ulp_floor=e.ulp_floor,
    )


@dataclass(frozen=True)
class _ElementErrors:
    """Each element's errors (float64, on the CPU) and the whole tensor's relative
    Frobenius error: what the criteria of a ``Tolerance`` are judged on."""

    nonfinite: torch.Tensor  # non-finite where the reference is not the same non-finite value
    diff: torch.Tensor  # |out - ref|, inf where ``nonfinite``
    absref: torch.Tensor
    rel: torch.Tensor  # diff / |ref|; 0 where the reference is 0
    ulp: torch.Tensor
    ulp_counted: torch.Tensor  # elements the ULP criterion covers
    ulp_floor: float
    rel_fro: float

    @classmethod
    def of(cls, out: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, r: torch.Tensor, tol: Tolerance) -> _ElementErrors:
        """``x``/``r``: ``out``/``ref`` in float64 on the CPU; ULPs are taken in ``out``'s own dtype."""
        nonfinite = ~torch.isfinite(x) & ~((x == r) | (torch.isnan(x) & torch.isnan(r)))
        diff = (x - r).abs()
        diff = torch.where(nonfinite, torch.full_like(diff, math.inf), torch.nan_to_num(diff, nan=0.0))
        absref = r.abs()
        nonzero = absref > 0
        rel = torch.where(nonzero, diff / torch.where(nonzero, absref, 1.0), torch.zeros_like(diff))
        ulp = ulp_distance(out.detach().cpu(), ref.detach().cpu()) if out.dtype in _INT_VIEW else torch.zeros_like(diff)

        finite_r = torch.nan_to_num(r, nan=0.0, posinf=0.0, neginf=0.0)
        ref_norm = float(torch.linalg.vector_norm(finite_r))
        err_norm = float(torch.linalg.vector_norm(diff))
        rel_fro = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else math.inf)
        # ULP only where it means something: |ref| at or above a floor relative to the
        # reference's RMS.  Non-finite values stay in, so an inf still shows.
        n_finite = int(torch.isfinite(r).sum())
        ulp_floor = tol.ulp_floor_rel * (ref_norm / math.sqrt(n_finite) if n_finite else 0.0)
        ulp_counted = (absref >= ulp_floor) | ~torch.isfinite(ulp)
        return cls(nonfinite, diff, absref, rel, ulp, ulp_counted, ulp_floor, rel_fro)


def _violations(e: _ElementErrors, tol: Tolerance) -> tuple[torch.Tensor, torch.Tensor]:
    """(elements past an elementwise criterion or non-finite, each element's score: how far past it is)."""
    if tol.elementwise:
        bound = (tol.atol or 0.0) + (tol.rtol or 0.0) * e.absref
        violation = e.diff > bound
        # Ratio of error to allowance: the worst element is the one furthest past it.
        score = torch.where(bound > 0, e.diff / torch.where(bound > 0, bound, 1.0), torch.where(e.diff > 0, math.inf, 0.0))
    else:
        violation = torch.zeros_like(e.diff, dtype=torch.bool)
        score = e.diff
    if tol.ulp is not None:
        violation = violation | ((e.ulp > tol.ulp) & e.ulp_counted)
    return violation | e.nonfinite, score


def _failed_criteria(tol: Tolerance, n_nonfinite: int, n_viol: int, max_ulp: float, ulp_floor: float,
                     rel_fro: float) -> tuple[list[str], list[str]]:
    """(why the result fails, one phrase per criterion; the failed criteria's names), in criterion order."""
    reasons: list[str] = []
    violated: list[str] = []
    if n_nonfinite:
        reasons.append(f"{n_nonfinite} non-finite value(s)")
        violated.append("nonfinite")
    if tol.elementwise and n_viol > n_nonfinite:
        reasons.append(f"{n_viol} element(s) beyond atol={tol.atol or 0:g} rtol={tol.rtol or 0:g}")
        violated.append("atol/rtol")
    if tol.ulp is not None and max_ulp > tol.ulp:
        where = f" over elements with |ref| >= {ulp_floor:.3g} ({tol.ulp_floor_rel:g} x RMS of the reference)" if ulp_floor > 0 else ""
        reasons.append(f"max ULP {max_ulp:g} > {tol.ulp}{where}")
        violated.append("ulp")
    if tol.rel_fro is not None and not rel_fro <= tol.rel_fro:
        reasons.append(f"relative Frobenius error {rel_fro:.3e} > {tol.rel_fro:g}")
        violated.append("rel_fro")
    return reasons, violated
