"""An MoE layer's native calls: the routed copies grouped by expert, the experts, the weighted sum back.

``cpu_kernels.c`` holds them (``cpu_bf16.c`` and ``cpu_int8.c`` the bf16 and W8A8 experts):

- ``moe_dispatch``: the routed copies grouped by expert (a counting sort, stable in token
  order, so the same order as the stable argsort), the rows gathered;
- ``moe_experts``: every expert's SwiGLU pair (gate/up, silu, down) over its rows, all
  experts in one call; the kernel is picked from the packs' type (fp32, bf16, or tagged
  W8A8 packs from ``pack_gate_up_w8a8`` / ``pack_down_w8a8``);
- ``moe_combine``: the weighted sum back, in each token's own top-k order;
- ``ep_dispatch`` / ``ep_combine``: the same dispatch and combine as an expert-parallel
  library's native section, with a modelled, bounded wait for the peer ranks
  (``ep_wait``: the bytes that cross ranks, ``ep_cross_bytes``, over the link).  Each call
  releases the GIL (``cpu_build.load()``, a ``CDLL``) or holds it (``load_holding_gil()``,
  a ``PyDLL``), per its ``release_gil`` argument.

Separate from ``cpu_kernels`` because these calls are one layer's data flow, and the
expert-parallel forms share their checks and buffers with the plain ones (``_dispatch``,
``_combine``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from refstack.kernels.cpu_build import load, load_holding_gil
from refstack.kernels.cpu_operands import check_fp32, check_index
from refstack.kernels.cpu_packs import (
    HALF,
    NB,
    check_packed,
    fits,
    is_tagged,
    read_header,
)

__all__ = ["ep_combine", "ep_cross_bytes", "ep_dispatch", "ep_wait", "moe_combine", "moe_dispatch", "moe_experts"]


def _moe_experts_w8a8(rows: Tensor, counts: list[int], gate_up: Tensor, down: Tensor) -> Tensor:
    h1, h2 = read_header(gate_up), read_header(down)
    D, inner, E = h1["K"], h1["N"] // 2, len(counts)
    if rows.dim() != 2 or rows.shape[1] != D or (h2["K"], h2["N"]) != (inner, D) or sum(counts) != rows.shape[0] \
            or gate_up.numel() != E * h1["total"] or down.numel() != E * h2["total"]:
        raise ValueError(f"moe_experts: rows {tuple(rows.shape)}, {E} counts, W8A8 packs of {gate_up.numel()} / "
                         f"{down.numel()} bytes (D={D}, I={inner}) do not match")
    return _run_experts(load().refstack_moe_experts_w8a8, "refstack_moe_experts_w8a8", rows, counts, D, inner,
                        gate_up, down)


def _run_experts(kernel: Any, name: str, rows: Tensor, counts: list[int], D: int, inner: int, gate_up: Tensor,
                 down: Tensor) -> Tensor:
    """One native grouped-experts call over validated operands: [n, D] out, an [n, inner] scratch."""
    rows = rows.contiguous()
    y = torch.empty_like(rows)
    if rows.shape[0] == 0:
        return y
    E = len(counts)
    offsets = torch.tensor([0, *counts], dtype=torch.int64).cumsum_(0)
    hidden = torch.empty(rows.shape[0], inner, dtype=rows.dtype)
    if kernel(rows.data_ptr(), offsets.data_ptr(), E, D, inner, gate_up.data_ptr(), down.data_ptr(), hidden.data_ptr(),
              y.data_ptr(), torch.get_num_threads()):
        raise ValueError(f"{name} rejected E={E} D={D} I={inner} counts={counts}")
    return y


def moe_experts(rows: Tensor, counts: list[int], gate_up: Tensor, down: Tensor) -> Tensor:
    """SwiGLU experts over ``rows`` [n, D] grouped by expert, ``counts`` rows per expert.

    ``gate_up`` from ``pack_gate_up``, ``down`` from ``pack_down`` (both fp32 or both
    bf16); returns [n, D]."""
    check_fp32("moe_experts", rows)
    check_packed("moe_experts", gate_up, down)
    if is_tagged(gate_up) and is_tagged(down):  # W8A8: pack_gate_up_w8a8 / pack_down_w8a8
        return _moe_experts_w8a8(rows, counts, gate_up, down)
    bf16 = gate_up.dtype == torch.bfloat16
    dims = 5 if bf16 else 4
    if gate_up.dim() != dims or down.dim() != dims or down.dtype != gate_up.dtype:
        raise ValueError(f"moe_experts: packed weights {gate_up.dtype} {tuple(gate_up.shape)} / {down.dtype} "
                         f"{tuple(down.shape)} must both be {dims}-d of one dtype")
    E, n_blocks = gate_up.shape[:2]
    inner = n_blocks * HALF
    D = rows.shape[1] if rows.dim() == 2 else -1
    if len(counts) != E or sum(counts) != rows.shape[0] or not fits(gate_up, D) or not fits(down, inner) \
            or down.shape[:2] != (E, -(-D // NB)):
        raise ValueError(f"moe_experts: rows {tuple(rows.shape)}, {len(counts)} counts, packed {tuple(gate_up.shape)} "
                         f"/ {tuple(down.shape)} do not match")
    kernel = load().refstack_moe_experts_bf16 if bf16 else load().refstack_moe_experts
    return _run_experts(kernel, "refstack_moe_experts", rows, counts, D, inner, gate_up, down)


def moe_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int
                 ) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """Routed copies grouped by expert (stable in token order), rows gathered.

    Returns (rows [T*k, D] in expert order, counts per expert, copy_slot [T, k]: the row
    of each (token, choice) copy, token_ids [T*k] and weights [T*k] in expert order)."""
    return _dispatch("moe_dispatch", load().refstack_moe_dispatch, x, topk_ids, topk_weights, num_experts)


def _dispatch(name: str, fn: Any, x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int,
              *extra: Any) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """The shared body of ``moe_dispatch`` and ``ep_dispatch``: checks, buffers, the C call
    ``fn`` (``extra``: its arguments after the thread count)."""
    check_fp32(name, x, topk_weights)
    check_index(name, topk_ids)
    T, k = topk_ids.shape
    if x.dim() != 2 or x.shape[0] != T or topk_weights.shape != (T, k):
        raise ValueError(f"{name}: x {tuple(x.shape)}, topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype}, "
                         f"topk_weights {tuple(topk_weights.shape)} do not match")
    x, ids, w = x.contiguous(), topk_ids.contiguous(), topk_weights.contiguous()
    D = x.shape[1]
    counts = torch.empty(num_experts, dtype=torch.int64)
    rows = torch.empty(T * k, D, dtype=x.dtype)
    slot = torch.empty(T, k, dtype=torch.int64)
    token_ids = torch.empty(T * k, dtype=torch.int64)
    weights = torch.empty(T * k, dtype=x.dtype)
    rc = fn(x.data_ptr(), T, D, ids.data_ptr(), w.data_ptr(), k, num_experts, counts.data_ptr(), rows.data_ptr(),
            slot.data_ptr(), token_ids.data_ptr(), weights.data_ptr(), None, torch.get_num_threads(), *extra)
    if rc:
        raise ValueError(f"{name}: expert ids must be in [0, {num_experts})" if rc == 2 else
                         f"refstack_{name} rejected T={T} D={D} k={k} E={num_experts}")
    return rows, counts.tolist(), slot, token_ids, weights


def _ep_lib(release_gil: bool) -> Any:  # a ctypes library handle: CDLL or PyDLL
    return load() if release_gil else load_holding_gil()


def ep_cross_bytes(topk_ids: Tensor, num_experts: int, ep_ranks: int, hidden: int) -> int:
    """Bytes of token rows that cross ranks in a dispatch (and come back in the combine):
    token t lives on rank ``t * ep_ranks // T`` (contiguous shards), a copy goes to the
    rank owning its expert (``expert // (num_experts / ep_ranks)``); fp32 rows."""
    check_index("ep_cross_bytes", topk_ids)
    T, k = topk_ids.shape
    ids = topk_ids.contiguous()
    return int(load().refstack_ep_cross_bytes(ids.data_ptr(), T, k, num_experts, ep_ranks, hidden))


def ep_wait(nbytes: int, ns_per_byte: float, *, release_gil: bool = True) -> int:
    """Wait ``nbytes * ns_per_byte`` ns (at most 50 ms) in C; returns the ns waited."""
    return int(_ep_lib(release_gil).refstack_ep_wait(nbytes, ns_per_byte))


def ep_dispatch(x: Tensor, topk_ids: Tensor, topk_weights: Tensor, num_experts: int, cross_bytes: int,
                ns_per_byte: float, *, release_gil: bool = True) -> tuple[Tensor, list[int], Tensor, Tensor, Tensor]:
    """``moe_dispatch`` as one native section that then waits ``cross_bytes * ns_per_byte`` ns
    for the peers; through the GIL-holding handle when ``release_gil`` is False."""
    return _dispatch("ep_dispatch", _ep_lib(release_gil).refstack_ep_dispatch, x, topk_ids, topk_weights, num_experts,
                     cross_bytes, ns_per_byte)


def ep_combine(out: Tensor, copy_slot: Tensor, copy_weights: Tensor, cross_bytes: int, ns_per_byte: float, *,
               release_gil: bool = True) -> Tensor:
    """``moe_combine`` as one native section that first waits ``cross_bytes * ns_per_byte`` ns
    for the expert outputs to come back; through the GIL-holding handle when ``release_gil`` is False."""
    return _combine("ep_combine", _ep_lib(release_gil).refstack_ep_combine, out, copy_slot, copy_weights,
                    cross_bytes, ns_per_byte)


def moe_combine(out: Tensor, copy_slot: Tensor, copy_weights: Tensor) -> Tensor:
    """``y[t] = sum_j copy_weights[t, j] * out[copy_slot[t, j]]``, in each token's own top-k order."""
    return _combine("moe_combine", load().refstack_moe_combine, out, copy_slot, copy_weights)


def _combine(name: str, fn: Any, out: Tensor, copy_slot: Tensor, copy_weights: Tensor, *extra: Any) -> Tensor:
    """The shared body of ``moe_combine`` and ``ep_combine`` (``extra``: the C call's
    arguments after the thread count)."""
    check_fp32(name, out, copy_weights)
    check_index(name, copy_slot)
    T, k = copy_slot.shape
    if out.dim() != 2 or copy_weights.shape != (T, k):
        raise ValueError(f"{name}: out {tuple(out.shape)}, copy_slot {tuple(copy_slot.shape)}, "
                         f"copy_weights {tuple(copy_weights.shape)} do not match")
    out, slot, w = out.contiguous(), copy_slot.contiguous(), copy_weights.contiguous()
    y = torch.empty(T, out.shape[1], dtype=out.dtype)
    rc = fn(out.data_ptr(), out.shape[0], slot.data_ptr(), w.data_ptr(), T, k, out.shape[1], y.data_ptr(), 0,
            torch.get_num_threads(), *extra)
    if rc:
        raise ValueError(f"{name}: copy_slot must index the {out.shape[0]} rows of out" if rc == 2 else
                         f"refstack_{name} rejected T={T} k={k} D={out.shape[1]}")
    return y

