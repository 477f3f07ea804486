"""Triton twin of ``tiled_kda.kda_decode_tiled``: one program per (sequence*head, V tile).

Imports triton at module import, so import this module only when the Triton path is
wanted (on a GPU, or on the CPU with ``TRITON_INTERPRET=1`` set *before* the import).
With ``counts`` given, every program atomically bumps the counter of its
(sequence, head): the number of times the norm and gate were computed for it, read
back from the kernel itself rather than derived from the launch grid.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from infra_agent.lab.tiled_kda import EPS, gate_flops, norm_flops
from infra_agent.lab.work import WorkCounter


@triton.jit
def _kda_decode_tile(q, k, v, a, b, S, o, counts, scale, eps, K: tl.constexpr, V: tl.constexpr, BV: tl.constexpr, COUNT: tl.constexpr):
    nh = tl.program_id(0)
    vt = tl.program_id(1)
    offs_k = tl.arange(0, K)
    offs_v = vt * BV + tl.arange(0, BV)
    # Recomputed by every V tile of this (sequence, head): the repeated work.
    qv = tl.load(q + nh * K + offs_k).to(tl.float32)
    kv = tl.load(k + nh * K + offs_k).to(tl.float32)
    qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + eps) * scale
    kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + eps)
    av = tl.load(a + nh * K + offs_k).to(tl.float32)
    softplus = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(av)))
    decay = tl.exp(-softplus)
    bv = tl.load(b + nh).to(tl.float32)
    beta = 1.0 / (1.0 + tl.exp(-bv))
    if COUNT:
        tl.atomic_add(counts + nh, 1)
    s_ptr = S + nh * K * V + offs_k[:, None] * V + offs_v[None, :]
    s = tl.load(s_ptr) * decay[:, None]
    vv = tl.load(v + nh * V + offs_v).to(tl.float32)
    kv_mem = tl.sum(s * kv[:, None], axis=0)
    delta = beta * (vv - kv_mem)
    s = s + kv[:, None] * delta[None, :]
    tl.store(s_ptr, s)
    out = tl.sum(s * qv[:, None], axis=0)
    tl.store(o + nh * V + offs_v, out.to(o.dtype.element_ty))


def kda_decode_triton(q, k, v, a, b, state, *, BV: int = 32, counter: WorkCounter | None = None, precision: str = "fp32"):  # type: ignore[no-untyped-def]
    """Same contract as ``kda_decode_tiled``: ``state`` is updated in place."""
    N, H, K = q.shape
    V = v.shape[-1]
    assert V % BV == 0 and state.dtype == torch.float32
    q, k, v, a, b = (t.contiguous() for t in (q, k, v, a, b))
    assert state.is_contiguous(), "the kernel writes the state in place; pass a contiguous one"
    o = torch.empty(N, H, V, dtype=q.dtype, device=q.device)
    counts = torch.zeros(N * H, dtype=torch.int32, device=q.device)
    _kda_decode_tile[(N * H, V // BV)](
        q, k, v, a, b, state, o, counts, K**-0.5, EPS, K=K, V=V, BV=BV, COUNT=counter is not None
    )
    if counter is not None:
        per_key = counts.reshape(N, H)
        counter.add_counts("l2norm_qk", per_key, norm_flops(K))
        counter.add_counts("gate", per_key, gate_flops(K))
    return {"o": o, "state": state}
