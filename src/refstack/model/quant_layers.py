"""The modules a W8A8 model runs: the int8 copies of a ``Linear`` and of an MoE layer's experts,
and the stand-in for a site left in the model's precision.

``smooth_and_quantize`` (``refstack.model.quant``) attaches them as ``Linear.w8a8`` and
``MoE.w8a8``.  Each one runs on torch's path (``torch._int_mm``, or the fused Triton GEMM on
CUDA, through ``quant_ops``) and packs itself for the native kernels (``pack``: the tagged
layouts of ``cpu_packs``).  Separate from ``quant`` because these are what a quantised model
holds and calls at every step; ``quant`` is what builds them, once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from refstack.kernels import cpu_kernels
from refstack.model.layers import matmul_rows, round_bf16
from refstack.model.quant_ops import (
    dequantize,
    fused_kernel_for,
    int_mm,
    quantize_rows,
    quantize_weight,
)

__all__ = ["HeldLinear", "QuantizedExperts", "QuantizedLinear"]


class QuantizedLinear(nn.Module):
    """The int8 copy of a ``Linear``: codes ``qweight_t`` [K, N] (int8, the layout
    ``torch._int_mm`` streams fastest on the CPU), ``scale`` [N], and ``inv_s`` [K] (the
    explicit 1/s, or None when s is folded into a preceding norm)."""

    qweight_t: Tensor
    scale: Tensor
    inv_s: Tensor | None

    def __init__(self, weight: Tensor, inv_s: Tensor | None) -> None:
        """``weight`` [N, K]: the smoothed weight, W diag(s)."""
        super().__init__()
        q, scale = quantize_weight(weight)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.register_buffer("qweight_t", q.t().contiguous(), persistent=False)
        self.register_buffer("scale", scale, persistent=False)
        self.register_buffer("inv_s", None if inv_s is None else inv_s.float().contiguous(), persistent=False)
        self._cuda_b: tuple[torch.device, Tensor] | None = None

    def pack(self) -> Tensor:
        """The native kernels' tagged pack (``cpu_kernels.pack_w8a8``)."""
        return cpu_kernels.pack_w8a8(self.qweight_t.t(), self.scale, self.inv_s)

    def _mm_weight(self) -> Tensor:
        if not self.qweight_t.is_cuda:
            return self.qweight_t
        # cuBLASLt's int8 path: column-major mat2 with K and N multiples of 8 (torchao's layout).
        dev = self.qweight_t.device
        if self._cuda_b is None or self._cuda_b[0] != dev:
            K, N = self.qweight_t.shape
            padded = F.pad(self.qweight_t, (0, -N % 8, 0, -K % 8))
            self._cuda_b = (dev, padded.t().contiguous().t())
        return self._cuda_b[1]

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)
        fused = fused_kernel_for(x2)
        if fused is not None:  # one launch on CUDA, the same bits (w8a8_triton)
            return fused.w8a8_matmul(x2, self.qweight_t, self.scale, self.inv_s).view(*x.shape[:-1], self.out_features)
        codes, sx = quantize_rows(x2, self.inv_s)
        acc = int_mm(codes, self._mm_weight())[:, : self.out_features]
        y = dequantize(acc, sx, self.scale)
        return y.view(*x.shape[:-1], self.out_features)


class QuantizedExperts(nn.Module):
    """An MoE layer's experts in int8: gate|up codes [E, 2I, D] with scales [E, 2I] (its input's
    1/s folded into the MLP norm), down codes [E, D, I] with scales [E, D] and the explicit
    per-expert 1/s [E, I] of its input (silu(gate) * up)."""

    q_gate_up: Tensor
    s_gate_up: Tensor
    q_down: Tensor
    s_down: Tensor
    inv_s_down: Tensor

    def __init__(self, w_gate_up: Tensor, w_down: Tensor, inv_s_down: Tensor) -> None:
        """``w_gate_up`` [E, D, 2I] (smoothed), ``w_down`` [E, I, D] (smoothed: rows times s)."""
        super().__init__()
        E = w_gate_up.shape[0]
        gu = [quantize_weight(w_gate_up[e].t()) for e in range(E)]
        dn = [quantize_weight(w_down[e].t()) for e in range(E)]
        self.inner = w_gate_up.shape[2] // 2
        self.register_buffer("q_gate_up", torch.stack([q for q, _ in gu]), persistent=False)
        self.register_buffer("s_gate_up", torch.stack([s for _, s in gu]), persistent=False)
        self.register_buffer("q_down", torch.stack([q for q, _ in dn]), persistent=False)
        self.register_buffer("s_down", torch.stack([s for _, s in dn]), persistent=False)
        self.register_buffer("inv_s_down", inv_s_down.float().contiguous(), persistent=False)
        # Per expert [K, N] int8 operands for torch._int_mm (gate|up, down), made on first use per device.
        self._mm: tuple[torch.device, Tensor, Tensor] | None = None

    def pack(self) -> tuple[Tensor, Tensor]:
        return (cpu_kernels.pack_gate_up_w8a8(self.q_gate_up, self.s_gate_up),
                cpu_kernels.pack_down_w8a8(self.q_down, self.s_down, self.inv_s_down))

    def _operands(self) -> tuple[Tensor, Tensor]:
        dev = self.q_down.device
        if self._mm is None or self._mm[0] != dev:
            self._mm = (dev, _mm_layout(self.q_gate_up), _mm_layout(self.q_down))
        return self._mm[1], self._mm[2]

    def expert(self, e: int, rows: Tensor) -> Tensor:
        """Expert e over rows [n, D]: down(silu(gate) * up), each GEMM W8A8."""
        fused = fused_kernel_for(rows)
        if fused is not None:  # on CUDA: one launch per GEMM (w8a8_triton)
            return self._fused_pair(fused, rows, slice(e, e + 1))
        b_gu, b_dn = self._operands()
        codes, sx = quantize_rows(rows)
        gu = dequantize(int_mm(codes, b_gu[e])[:, : 2 * self.inner], sx, self.s_gate_up[e])
        gate, up = gu.chunk(2, dim=-1)
        codes, sx = quantize_rows(F.silu(gate).mul_(up), self.inv_s_down[e])
        return dequantize(int_mm(codes, b_dn[e])[:, : self.s_down.shape[1]], sx, self.s_down[e])

    def grouped(self, buf: Tensor, counts: list[int], first: int) -> Tensor:
        """Rows grouped by expert (``counts`` per local expert, experts ``first``...)."""
        out = torch.empty_like(buf)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out[start : start + n] = self.expert(first + e, buf[start : start + n])
                start += n
        return out

    def padded(self, buf: Tensor, first: int) -> Tensor:
        """A padded buffer [E_r, capacity, D] (empty rows are zeros and give zeros)."""
        fused = fused_kernel_for(buf)
        if fused is not None:  # on CUDA: one launch per GEMM for all the experts
            return self._fused_pair(fused, buf, slice(first, first + buf.shape[0]))
        return torch.stack([self.expert(first + e, buf[e]) for e in range(buf.shape[0])])

    def _fused_pair(self, fused: Any, rows: Tensor, experts: slice) -> Tensor:
        """gate|up, silu(gate) * up and down through ``w8a8_triton`` for ``experts``: rows
        [E, n, D] (or [n, D] for one expert), the unfused path's arithmetic."""
        one = rows.dim() == 2
        x = rows.unsqueeze(0) if one else rows
        gu = fused.w8a8_matmul(x, self.q_gate_up[experts].transpose(1, 2), self.s_gate_up[experts])
        gate, up = gu.chunk(2, dim=-1)
        y = fused.w8a8_matmul(F.silu(gate).mul_(up), self.q_down[experts].transpose(1, 2), self.s_down[experts],
                              self.inv_s_down[experts])
        return y[0] if one else y


def _mm_layout(q: Tensor) -> Tensor:
    """Codes [E, N, K] as per-expert ``torch._int_mm`` operands [E, K, N]: row-major on the CPU
    (its fast layout), column-major with K and N padded to multiples of 8 on CUDA (see ``int_mm``)."""
    if q.is_cuda:
        return F.pad(q, (0, -q.shape[2] % 8, 0, -q.shape[1] % 8)).transpose(1, 2)
    return q.transpose(1, 2).contiguous()


class HeldLinear(nn.Module):
    """A Linear of a W8A8 model left in the model's precision (``HELD_SITES``).  It stands in
    ``Linear.w8a8`` so that the Linear packs it behind the tagged header: a native decode block
    reads all its weights with one kind, and its other weights are int8.  It holds the
    Linear's own weight (no copy)."""

    def __init__(self, weight: Tensor, bf16: bool) -> None:
        super().__init__()
        self.weight = weight  # the Linear's parameter itself: .to(device) moves it in place
        self.bf16 = bf16

    def pack(self) -> Tensor:
        return cpu_kernels.pack(self.weight.t(), torch.bfloat16 if self.bf16 else torch.float32, tagged=True)

    def forward(self, x: Tensor) -> Tensor:  # torch's path: as Linear.forward computes it
        return matmul_rows(round_bf16(x) if self.bf16 else x, self.weight.t())
