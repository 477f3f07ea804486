"""KDA decode on the GPU: one gated-delta-rule step per sequence, in one Triton launch.

The step (per sequence n, head h; state ``S [K, V]`` fp32, updated in place in its
slot of the state pool)::

    qn, kn = q / |q|, k / |k|                 # L2 norm, in the kernel
    g      = -exp(A_log[h]) * softplus(f + dt_bias)
    beta   = sigmoid(b)
    d      = exp(g)                           # per K channel
    S      = d * S ; u = beta (v - kn^T S) ; S = S + kn u^T
    o      = scale * qn^T S

Two forms share one kernel body; they differ in what one program covers:

- ``tiled``: one program per (sequence, head, V tile of ``BV`` columns), the layout of
  fla-core's ``fused_recurrent_kda`` (BV=32 there).  The V columns are independent, so
  this is exact, but every tile needs the whole normalised q, k and gate: the norm
  and gate are recomputed V/BV times per (sequence, head).
- ``fused``: one program per (sequence, head) over all of V, in ``BV``-column
  sub-tiles loaded one after the other; norm and gate are computed once.

Both read the old state once and get both products they need from it
(``(qn*d)^T S`` and ``(kn*d)^T S``), so the state is read once and written once: the
step is a copy of the state with a little arithmetic, and its ceiling is the
device's copy bandwidth.  ``form="auto"`` picks per batch size (see ``pick_form``).

Continuous batching: ``slots[n]`` names sequence n's row in the state pool, so the
engine's cache is updated where it lives, with no gather or scatter.

With ``counts`` given, every program bumps the counter of its (sequence, head) once
per norm-and-gate computation; the kernel lab reads the repeat factor from it
(``infra_agent.lab.work``), measured rather than derived from the grid.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

FORMS = ("tiled", "fused", "auto")
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class LaunchConfig:
    """What one program covers and how it is laid out."""

    cols_per_program: int  # V columns one program owns (V: the fused form)
    block_v: int  # columns per unrolled sub-tile
    num_warps: int
    # Cache hint on the state's load and store.  None by default: "evict_first" cost
    # 2-4% at N >= 32 in the H200 sweep.
    evict: str = ""
    # Load sub-tile i+1 before sub-tile i's math.  Off by default: on the H200 it cost
    # 1.2-2.8% at N >= 128 (two [K, BV] tiles live per thread instead of one), and the
    # other resident program hides the load as well (docs/performance.md).
    prefetch: bool = False


@triton.jit
def _kda_decode_kernel(
    q, k, v, f, b, A_log, dt_bias, state, slots, o, counts,
    scale, eps,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    COLS: tl.constexpr, BV: tl.constexpr,
    HAS_BIAS: tl.constexpr, COUNT: tl.constexpr, EVICT: tl.constexpr, PREFETCH: tl.constexpr,
):
    nh = tl.program_id(0).to(tl.int64)
    col0 = tl.program_id(1) * COLS
    h = nh % H
    n = nh // H
    offs_k = tl.arange(0, K)
    # The state tile's load goes out first: it is the step's long pole (a dependent
    # load behind the slot index), and the norm and gate below overlap with it.
    slot = tl.load(slots + n).to(tl.int64)
    s_base = state + (slot * H + h) * K * V
    offs_v = col0 + tl.arange(0, BV)
    s_next = tl.load(s_base + offs_k[:, None] * V + offs_v[None, :], eviction_policy=EVICT)
    # Norm and gate: once per program.  In the tiled form a (sequence, head) has V/COLS
    # programs, so this is the repeated work the lab's accounting measures.
    qv = tl.load(q + nh * K + offs_k).to(tl.float32)
    kv = tl.load(k + nh * K + offs_k).to(tl.float32)
    qv = qv / tl.sqrt(tl.sum(qv * qv, axis=0) + eps)
    kv = kv / tl.sqrt(tl.sum(kv * kv, axis=0) + eps)
    fv = tl.load(f + nh * K + offs_k).to(tl.float32)
    if HAS_BIAS:
        fv += tl.load(dt_bias + h * K + offs_k).to(tl.float32)
    # softplus with the large-argument shortcut: log1p(exp(x)) == x in fp32 past 20.
    softplus = tl.where(fv > 20.0, fv, tl.log(1.0 + tl.exp(fv)))
    decay = tl.exp(-tl.exp(tl.load(A_log + h).to(tl.float32)) * softplus)
    beta = tl.sigmoid(tl.load(b + nh).to(tl.float32))
    if COUNT:
        tl.atomic_add(counts + nh, 1)
    qd = qv * decay
    kd = kv * decay
    qk = tl.sum(qv * kv, axis=0)
    for i in tl.static_range(COLS // BV):
        offs_v = col0 + i * BV + tl.arange(0, BV)
        if i == 0 or PREFETCH:
            s = s_next
        else:
            s = tl.load(s_base + offs_k[:, None] * V + offs_v[None, :], eviction_policy=EVICT)
        if PREFETCH and i + 1 < COLS // BV:  # the next sub-tile's load in flight during this one's math
            s_next = tl.load(s_base + offs_k[:, None] * V + (offs_v + BV)[None, :], eviction_policy=EVICT)
        vv = tl.load(v + nh * V + offs_v).to(tl.float32)
        k_s = tl.sum(s * kd[:, None], axis=0)
        q_s = tl.sum(s * qd[:, None], axis=0)
        u = beta * (vv - k_s)
        tl.store(s_base + offs_k[:, None] * V + offs_v[None, :], s * decay[:, None] + kv[:, None] * u[None, :],
                 eviction_policy=EVICT)
        out = (q_s + qk * u) * scale
        tl.store(o + nh * V + offs_v, out.to(o.dtype.element_ty))


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def pick_form(n: int, h: int, device: torch.device) -> str:
    """The fused form once (sequence, head) pairs fill the GPU; else the tiled one.

    One fused program streams a whole [K, V] state.  With fewer (sequence, head) pairs
    than about four per SM, most SMs would sit idle and the step is latency-bound:
    splitting V gives the parallelism back, and the norm and gate it repeats cost
    nothing there.  Measured on an H200 (docs/performance.md, ``bench/kda_decode.py
    --sweep``): tiled wins at N*H <= 256, fused from N*H = 1024 on.
    """
    if device.type != "cuda":
        return "fused"
    return "fused" if n * h >= 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device()) \
        else "tiled"


@functools.cache
def _sm_count(index: int) -> int:
    # Asked once per device: this runs on every decode step of every KDA layer.
    return torch.cuda.get_device_properties(index).multi_processor_count


def launch_config(form: str, V: int) -> LaunchConfig:
    """The configs the H200 sweep picked; one warp per tile is also vLLM's choice."""
    if form == "tiled":
        return LaunchConfig(cols_per_program=min(32, V), block_v=min(32, V), num_warps=1)
    return LaunchConfig(cols_per_program=V, block_v=min(64, V), num_warps=4)


class KDAShapeError(ValueError):
    """Inputs the kernel does not take; raised before any launch."""


def _validate(q, k, v, f, b, A_log, dt_bias, state, slots) -> None:  # type: ignore[no-untyped-def]
    N, H, K = q.shape
    V = v.shape[-1]
    for name, t, shape in (("k", k, (N, H, K)), ("f", f, (N, H, K)), ("v", v, (N, H, V)), ("b", b, (N, H))):
        if tuple(t.shape) != shape:
            raise KDAShapeError(f"kda_decode: {name} has shape {tuple(t.shape)}, expected {shape}")
    if not (_is_pow2(K) and _is_pow2(V)) or K < 16 or V < 16:
        raise KDAShapeError(f"kda_decode: K={K} and V={V} must be powers of two >= 16 (the kernel's tiles)")
    for name, t in (("q", q), ("k", k), ("v", v), ("f", f), ("b", b)):
        if t.dtype not in INPUT_DTYPES:
            raise KDAShapeError(f"kda_decode: {name} is {t.dtype}; the kernel takes {', '.join(map(str, INPUT_DTYPES))}")
        if not t.is_contiguous():
            raise KDAShapeError(f"kda_decode: {name} must be contiguous")
    if state.dtype != torch.float32 or state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V) or not state.is_contiguous():
        raise KDAShapeError(f"kda_decode: state must be a contiguous fp32 [slots, {H}, {K}, {V}] pool, got "
                            f"{state.dtype} {tuple(state.shape)}")
    if tuple(A_log.shape) != (H,):
        raise KDAShapeError(f"kda_decode: A_log has shape {tuple(A_log.shape)}, expected ({H},)")
    if dt_bias is not None and dt_bias.numel() != H * K:
        raise KDAShapeError(f"kda_decode: dt_bias has {dt_bias.numel()} elements, expected H*K={H * K}")
    if tuple(slots.shape) != (N,) or slots.dtype not in (torch.int32, torch.int64):
        raise KDAShapeError(f"kda_decode: slots must be int32/int64 of shape ({N},), got {slots.dtype} {tuple(slots.shape)}")
    devices = {t.device for t in (q, k, v, f, b, A_log, state, slots)}
    if len(devices) != 1:
        raise KDAShapeError(f"kda_decode: all tensors must be on one device, got {sorted(map(str, devices))}")


def check_slots(slots: torch.Tensor, num_slots: int) -> None:
    """The debug check: every slot index inside the pool (costs a device sync)."""
    if slots.numel() and (int(slots.min()) < 0 or int(slots.max()) >= num_slots):
        bad = slots[(slots < 0) | (slots >= num_slots)].tolist()
        raise IndexError(f"kda_decode: slot indices {bad[:8]} are outside the state pool of {num_slots} slots")


def debug_checks_enabled() -> bool:
    return os.environ.get("REFSTACK_KDA_DEBUG", "") not in ("", "0")


def kda_decode(q, k, v, f, b, state, slots, *, A_log, dt_bias=None, scale=None, eps=1e-6, form="auto",  # type: ignore[no-untyped-def]
               out=None, counts=None, validate=True, debug=None, config: LaunchConfig | None = None):
    """One KDA decode step for N sequences; ``state`` rows ``slots`` are updated in place.

    q, k, f: [N, H, K] raw projections (f: the decay pre-activation); v: [N, H, V];
    b: [N, H] raw beta logits; A_log: [H]; dt_bias: [H*K] or None; state: fp32
    [slots, H, K, V]; slots: [N] int32/int64.  Returns o [N, H, V] in v's dtype.
    ``counts`` (int32 [N*H], zeroed by the caller) receives the norm-and-gate
    computations per (sequence, head).  ``debug`` (default: env REFSTACK_KDA_DEBUG)
    checks slot indices against the pool before launch.
    """
    if validate:
        if form not in FORMS:
            raise KDAShapeError(f"kda_decode: form must be one of {FORMS}, got {form!r}")
        _validate(q, k, v, f, b, A_log, dt_bias, state, slots)
    if debug if debug is not None else debug_checks_enabled():
        check_slots(slots, state.shape[0])
    N, H, K = q.shape
    V = v.shape[-1]
    if config is None:
        config = launch_config(pick_form(N, H, q.device) if form == "auto" else form, V)
    if out is None:
        out = torch.empty_like(v)
    if N == 0:
        return out
    _kda_decode_kernel[(N * H, V // config.cols_per_program)](
        q, k, v, f, b, A_log, dt_bias if dt_bias is not None else A_log, state, slots, out,
        counts if counts is not None else slots,
        K**-0.5 if scale is None else scale, eps,
        H=H, K=K, V=V, COLS=config.cols_per_program, BV=config.block_v,
        HAS_BIAS=dt_bias is not None, COUNT=counts is not None, EVICT=config.evict, PREFETCH=config.prefetch,
        num_warps=config.num_warps,
    )
    return out
