"""A KDA-like decode step tiled over V, instrumented for work accounting.

One gated-delta-rule step per (sequence, head) with a per-channel gate, as in KDA
decode (T=1): the state ``S [K, V]`` decays by ``exp(g)``, the delta rule writes
``beta * (v - S^T k)`` along ``k``, and the output is ``S^T q``.  q and k are
L2-normalised and the gate ``g = -softplus(a)``, ``beta = sigmoid(b)`` are computed
inside the step.

Like fla-core's ``fused_recurrent_kda_fwd``, the tiled form runs one program per
(sequence, head, V tile).  The V columns are independent, so tiling is exact -- but
each tile needs the whole normalised q, k and the whole gate, so every tile
recomputes them: V/BV times per (sequence, head).  ``kda_decode_tiled`` reports each
piece of work into a ``WorkCounter`` so that repetition is measured, not assumed.
The Triton twin lives in ``tiled_kda_triton`` (imported only when asked for).
"""

from __future__ import annotations

import torch

from infra_agent.lab.work import WorkCounter

EPS = 1e-6


def norm_flops(K: int) -> float:
    # Per vector: K squares, K adds, one sqrt, K divides; q and k; plus q's scale.
    return 2 * (3 * K + 1) + K


def gate_flops(K: int) -> float:
    # softplus = log(1 + exp(a)): 3 per channel; exp(g): 1; sigmoid(b): ~3 for beta.
    return 4 * K + 3


def tile_flops(K: int, BV: int) -> float:
    # decay K*BV; S^T k 2*K*BV; beta*(v - .) 2*BV; rank-1 update 2*K*BV; S^T q 2*K*BV.
    return 7 * K * BV + 2 * BV


def _normalise_and_gate(q: torch.Tensor, k: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    K = q.shape[-1]
    qf, kf = q.float(), k.float()
    qn = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + EPS) * K**-0.5
    kn = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + EPS)
    decay = torch.exp(-torch.nn.functional.softplus(a.float()))
    beta = torch.sigmoid(b.float())
    return qn, kn, decay, beta


def kda_decode_reference(q, k, v, a, b, state) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Untiled float64 step; returns ``o [N,H,V]`` in q's dtype and the new fp32 state."""
    qn, kn, decay, beta = (t.double() for t in _normalise_and_gate(q, k, a, b))
    s = state.double() * decay[..., None]
    kv_mem = torch.einsum("nhkv,nhk->nhv", s, kn)
    s = s + kn[..., None] * (beta[..., None] * (v.double() - kv_mem))[..., None, :]
    o = torch.einsum("nhkv,nhk->nhv", s, qn)
    return {"o": o.to(q.dtype), "state": s.float()}


def kda_decode_tiled(q, k, v, a, b, state, *, BV: int = 32, counter: WorkCounter | None = None, precision: str = "fp32"):  # type: ignore[no-untyped-def]
    """The tiled step; updates ``state [N,H,K,V]`` (fp32) in place, like the GPU kernel.

    ``precision`` is accepted for the lab's calling convention; the step is fp32.
    """
    N, H, K = q.shape
    V = v.shape[-1]
    assert V % BV == 0, f"V={V} must be a multiple of BV={BV}"
    o = torch.empty(N, H, V, dtype=q.dtype, device=q.device)
    for n in range(N):
        for h in range(H):
            for t in range(V // BV):
                # One "program": everything it needs is recomputed from the inputs.
                qn, kn, decay, beta = _normalise_and_gate(q[n, h], k[n, h], a[n, h], b[n, h])
                if counter is not None:
                    counter.add("l2norm_qk", norm_flops(K), key=(n, h))
                    counter.add("gate", gate_flops(K), key=(n, h))
                    counter.add("state_update", tile_flops(K, BV), key=(n, h, t))
                cols = slice(t * BV, (t + 1) * BV)
                s = state[n, h, :, cols] * decay[:, None]
                delta = beta * (v[n, h, cols].float() - kn @ s)
                s = s + kn[:, None] * delta[None, :]
                state[n, h, :, cols] = s
                o[n, h, cols] = (qn @ s).to(o.dtype)
    return {"o": o, "state": state}


def kda_decode_inputs(shape, dtype, seed, device) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """Random decode inputs for ``{"N", "H", "K", "V"}``; the state is always fp32."""
    g = torch.Generator().manual_seed(seed)
    N, H, K, V = shape["N"], shape["H"], shape["K"], shape["V"]
    t = {
        "q": torch.randn(N, H, K, generator=g),
        "k": torch.randn(N, H, K, generator=g),
        "v": torch.randn(N, H, V, generator=g),
        "a": torch.randn(N, H, K, generator=g),
        "b": torch.randn(N, H, generator=g),
    }
    out = {name: x.to(device=device, dtype=dtype) for name, x in t.items()}
    out["state"] = (0.1 * torch.randn(N, H, K, V, generator=g)).to(device)
    return out


def kda_decode_bytes(shape, dtype) -> float:  # type: ignore[no-untyped-def]
    """State read+write (fp32) plus q, k, v, gate, beta and the output, as in ANCHORS."""
    N, H, K, V = shape["N"], shape["H"], shape["K"], shape["V"]
    el = torch.empty((), dtype=dtype).element_size()
    return N * H * (2 * K * V * 4 + (3 * K + 2 * V + 1) * el)


def kda_decode_flops(shape) -> float:  # type: ignore[no-untyped-def]
    """Useful work only: norm and gate once per (sequence, head)."""
    N, H, K, V = shape["N"], shape["H"], shape["K"], shape["V"]
    return N * H * (norm_flops(K) + gate_flops(K) + tile_flops(K, V))
