"""Small building blocks: seeded weights, linear, RMSNorm, embedding, LM head."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels import cpu_kernels
from refstack.kernels.precision import matmul as precision_matmul

if TYPE_CHECKING:
    from refstack.model.quant_layers import HeldLinear, QuantizedLinear


def seeded_weight(gen: torch.Generator, *shape: int, std: float) -> nn.Parameter:
    """A normal(0, std) parameter drawn from ``gen``.

    Every weight comes from one generator seeded by the config, drawn in
    construction order, so the same config always builds the same model and the
    global RNG is never touched.
    """
    w = torch.empty(*shape, dtype=torch.float32)
    w.normal_(0.0, std, generator=gen)
    return nn.Parameter(w, requires_grad=False)


def round_bf16(x: Tensor) -> Tensor:
    """x rounded to the nearest bf16 (ties to even), kept in fp32: a bf16 GEMM operand."""
    return x.to(torch.bfloat16).to(torch.float32)


# Up to this many rows, ``x @ w`` runs as ``(w^T @ x^T)^T`` (see matmul_rows).
FEW_ROWS = 8


def matmul_rows(x: Tensor, w: Tensor) -> Tensor:
    """``x @ w`` for activations x [M, in] and a weight w [in, out]; contiguous result.

    Decode multiplies a handful of rows by a large weight, so the step is bound by
    streaming the weight.  For M <= 8 MKL streams it 1.5-3x faster (and, unlike the
    plain form, splits it over the threads) when the weight is the left operand:
    ``w^T [out, in] @ x^T``, with ``w^T`` row-major and ``x^T`` a transposed view of a
    row-major x (a contiguous ``x^T`` takes a slow path).  Callers store weights
    [out, in] and pass ``w`` as a transposed view, so no weight is ever copied.
    Measured on the 2-core bench box, fp32, weights 512-900 x 256-512.
    """
    if x.dim() == 2 and x.shape[0] <= FEW_ROWS and not x.is_cuda:  # an MKL habit; cuBLAS needs no help
        # The copies are of M rows only; downstream ops and the next matmul_rows want
        # row-major activations.
        return (w.t() @ x.contiguous().t()).t().contiguous()
    return x @ w


class Linear(nn.Module):
    """``y = x @ W^T`` without a bias; fan-in scaled init keeps activations near unit scale.

    With ``use_native(True)`` it runs the packed native kernel (``refstack.kernels.cpu_kernels``)
    on a column-blocked copy of the weight; the parameter itself stays as it is.
    After ``round_to_bf16()`` it is a bf16 GEMM: bf16 weight, input rounded to bf16, fp32
    accumulation (the torch path computes the same in fp32 on the rounded values).
    With ``w8a8`` set (``refstack.model.quant``) it is a W8A8 GEMM: the native kernel on its
    tagged int8 pack, or ``torch._int_mm``; ``weight`` then is the unquantised (smoothed) weight.
    """

    def __init__(self, in_features: int, out_features: int, gen: torch.Generator, scale: float = 1.0) -> None:
        super().__init__()
        self.weight = seeded_weight(gen, out_features, in_features, std=scale / math.sqrt(in_features))
        self.packed: Tensor | None = None  # not a buffer: derived, never saved
        self.bf16 = False
        # Set by refstack.model.quant: the int8 copy, or a HeldLinear (a site W8A8 leaves unquantised).
        self.w8a8: QuantizedLinear | HeldLinear | None = None

    def round_to_bf16(self) -> None:
        """Make this a bf16 GEMM (irreversible: the weight itself is rounded); before ``use_native``."""
        self.weight.copy_(round_bf16(self.weight))
        self.bf16 = True

    def use_native(self, on: bool) -> None:
        if self.w8a8 is not None:
            self.packed = self.w8a8.pack() if on else None
            return
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        self.packed = cpu_kernels.pack(self.weight.t(), dtype) if on else None

    def forward(self, x: Tensor) -> Tensor:
        if self.packed is not None and x.dtype == torch.float32:
            y = cpu_kernels.gemm(x.reshape(-1, x.shape[-1]), self.packed, self.weight.shape[0])
            return y.view(*x.shape[:-1], y.shape[-1])
        if self.w8a8 is not None:
            return self.w8a8(x)
        return matmul_rows(round_bf16(x) if self.bf16 else x, self.weight.t())


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, gen: torch.Generator | None = None) -> None:
        super().__init__()
        self.eps = eps
        # A random gain around 1 (when a generator is given) so the norm is not a no-op
        # that would hide a missing multiply in a test.
        w = torch.ones(dim)
        if gen is not None:
            w += 0.1 * torch.randn(dim, generator=gen)
        self.weight = nn.Parameter(w, requires_grad=False)
        self.native = False  # see use_native

    def use_native(self, on: bool) -> None:
        self.native = on

    def forward(self, x: Tensor) -> Tensor:
        if self.native:
            return cpu_kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int, gen: torch.Generator) -> None:
        super().__init__()
        self.weight = seeded_weight(gen, vocab_size, dim, std=1.0)

    def forward(self, ids: Tensor) -> Tensor:
        return F.embedding(ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to logits through the selectable-precision matmul (case study A)."""

    def __init__(self, dim: int, vocab_size: int, precision: str, gen: torch.Generator) -> None:
        super().__init__()
        self.precision = precision
        # Stored as [dim, vocab] (already transposed) so each call is one plain a @ b.
        self.weight_t = seeded_weight(gen, dim, vocab_size, std=1.0 / math.sqrt(dim))
        self.packed: Tensor | None = None  # see use_native

    def use_native(self, on: bool) -> None:
        """fp32 and bf16 through the native GEMM, whose semantics are those modes' exactly
        (fp32 operands; or both rounded to bf16, fp32 accumulation); tf32 and 3xtf32 keep
        their emulation."""
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(self.precision)
        self.packed = cpu_kernels.pack(self.weight_t, dtype) if on and dtype is not None else None

    def forward(self, h: Tensor) -> Tensor:
        with tracing.span("lm_head", cat="lm_head", tokens=int(h.shape[0]), precision=self.precision):
            return self.logits(h)

    def logits(self, h: Tensor) -> Tensor:
        """``forward`` without its span (the native decode step records its own)."""
        if self.packed is not None and h.dim() == 2 and h.dtype == torch.float32 and not h.is_cuda:
            return cpu_kernels.gemm(h, self.packed, self.weight_t.shape[1])
        return precision_matmul(h, self.weight_t, precision=self.precision)
