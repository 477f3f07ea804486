"""The gated delta rule of KDA in three forms: naive, recurrent (decode), chunked (prefill).

Per head, with state ``S`` of shape ``[K, V]`` and per-channel log decay ``g_t`` (<= 0):

    S_t = diag(exp(g_t)) S_{t-1}                       # decay along K
    S_t = S_t + beta_t k_t (v_t - k_t^T S_t)^T         # delta rule
    o_t = scale * q_t^T S_t

Chunked form (derivation, per chunk of C steps starting from state S0).  With the
within-chunk cumulative decay ``G_t = sum_{i<=t} g_i`` the state is

    S_t = diag(e^{G_t}) S0 + sum_{i<=t} diag(e^{G_t - G_i}) k_i u_i^T

for "pseudo values" ``u_t = beta_t (v_t - k_t^T diag(e^{g_t}) S_{t-1})``.  Writing
``A[t,i] = beta_t sum_d k_td k_id e^{G_td - G_id}`` (i < t) gives the unit lower
triangular system ``(I + A) U = beta V - beta (K e^G) S0``, i.e. the UT transform

    W  = (I + A)^{-1} (beta K e^G),   U0 = (I + A)^{-1} (beta V),   U = U0 - W S0.

Everything except ``W S0`` is independent of the incoming state, so it is computed
for all chunks at once; only four small matmuls per chunk remain sequential:

    O    = scale * [(Q e^G) S0 + P U],        P[t,i] = sum_d q_td k_id e^{G_td - G_id} (i <= t)
    S_C  = diag(e^{G_C}) S0 + (K e^{G_C - G})^T U
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

# Sub-chunk length for the intra-chunk decay products (see _decay_scores).
SUB_CHUNK = 16
# Largest decay exponent over a block (chunk or sub-chunk) that is factored into
# e^{G_t} e^{-G_i}; e^60 is far from fp32's e^88 overflow and e^-60 far from the
# e^-87 underflow to denormals.
SAFE_EXPONENT = 60.0


def kda_naive(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, scale: float
) -> tuple[Tensor, Tensor]:
    """Token-by-token reference, written straight from the recurrence (tests only).

    q, k, g: [T, H, K]; v: [T, H, V]; beta: [T, H]; initial_state: [H, K, V].
    Returns (o [T, H, V], final state [H, K, V]).
    """
    S = initial_state.clone()
    outs = []
    for t in range(q.shape[0]):
        S = S * torch.exp(g[t])[:, :, None]
        predicted = torch.einsum("hk,hkv->hv", k[t], S)
        S = S + beta[t][:, None, None] * torch.einsum("hk,hv->hkv", k[t], v[t] - predicted)
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
    return torch.stack(outs), S


def kda_recurrent_step(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, scale: float, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """One decode step for a batch of sequences.

    q, k, g: [B, H, K]; v: [B, H, V]; beta: [B, H]; state: [B, H, K, V], updated in
    place when ``inplace`` (it may be a view into the cache's state slots).
    Returns (o [B, H, V], new state [B, H, K, V]).

    Decode is memory-bound on the state, so the step reads the old state once for
    both products it needs, then updates it in place.  With ``d = exp(g)``:

        u       = beta (v - k^T (d * S_{t-1})) = beta (v - (k * d)^T S_{t-1})
        q^T S_t = (q * d)^T S_{t-1} + (q . k) u
        S_t     = d * S_{t-1} + k u^T
    """
    d = torch.exp(g)
    qk = torch.stack([q * d, k * d], dim=-2)  # [B, H, 2, K]
    q_S, k_S = (qk @ state).unbind(-2)  # [B, H, V] each
    u = beta.unsqueeze(-1) * (v - k_S)
    o = (q_S + (q * k).sum(-1, keepdim=True) * u) * scale
    S = state if inplace else state.clone()
    S.mul_(d.unsqueeze(-1)).addcmul_(k.unsqueeze(-1), u.unsqueeze(-2))
    return o, S


def _chunk_factorable(G: Tensor) -> bool:
    """Whether no channel decays by more than e^-SAFE_EXPONENT over a whole chunk."""
    return float(G[..., -1, :].amin()) > -SAFE_EXPONENT


def _factorable(G: Tensor) -> bool:
    """Whether no channel decays by more than e^-SAFE_EXPONENT over the block (dim -2)."""
    return float((G[..., :1, :] - G[..., -1:, :]).amax()) < SAFE_EXPONENT


def _factored_scores(a: Tensor, b: Tensor, G: Tensor) -> Tensor:
    """``(a e^{G - G_0}) (b e^{G_0 - G})^T``: one matmul, exact where i <= t, unmasked."""
    first = G[..., :1, :]
    return (a * torch.exp(G - first)) @ (b * torch.exp(first - G)).transpose(-1, -2)


def _decay_scores(a: Tensor, b: Tensor, G: Tensor, strict: bool) -> Tensor:
    """``M[t, i] = sum_d a_td b_id exp(G_td - G_id)`` for i < t (strict) or i <= t, else 0.

    a, b, G: [..., C, K] -> [..., C, C].

    This is the path for chunks whose decay is too strong to factor as a whole
    (``e^{G_t} e^{-G_i}`` overflows fp32 once a channel decays by more than ~e^-88
    inside the chunk; see kda_chunked's fast path).  The chunk is split into
    sub-chunks: pairs within one sub-chunk are factored at its first position when
    that is safe, else get the exact pairwise exponent, and pairs across sub-chunks are
    factored at the end ``R`` of the key's sub-chunk: ``e^{G_t - R} e^{R - G_i}``.  G
    only decreases, so both factors are <= 1; either may underflow, harmlessly, since
    the true product is then smaller still.
    """
    *lead, C, _ = a.shape
    sub = min(SUB_CHUNK, C)
    assert C % sub == 0, f"chunk {C} must be a multiple of the sub-chunk {sub}"
    nb = C // sub
    Gs, As, Bs = (x.unflatten(-2, (nb, sub)) for x in (G, a, b))
    neg_inf = float("-inf")

    # Pairs inside one sub-chunk.
    tri = torch.ones(sub, sub, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    if _factorable(Gs):
        diag = _factored_scores(As, Bs, Gs).masked_fill_(~tri, 0.0)
    else:
        # Extreme decay: exact pairwise exponents [..., nb, t, i, K], all <= 0.
        decay = (Gs.unsqueeze(-2) - Gs.unsqueeze(-3)).masked_fill(~tri.unsqueeze(-1), neg_inf).exp_()
        diag = (As.unsqueeze(-2) * decay * Bs.unsqueeze(-3)).sum(-1)  # [..., nb, sub, sub]
    if nb == 1:
        return diag.reshape(*lead, C, C)

    # Pairs across sub-chunks (query sub-chunk later than the key's).
    ref = Gs[..., -1, :]  # [..., nb, K]: cumulative decay at the end of each key sub-chunk
    keys = Bs * torch.exp(ref.unsqueeze(-2) - Gs)  # [..., nb, sub, K]
    query_block = torch.arange(C, device=a.device) // sub
    later = query_block.unsqueeze(0) > torch.arange(nb, device=a.device).unsqueeze(1)  # [nb, C]
    expo = (G.unsqueeze(-3) - ref.unsqueeze(-2)).masked_fill(~later.unsqueeze(-1), neg_inf)
    queries = a.unsqueeze(-3) * expo.exp_()  # [..., nb, C, K]
    cross = queries @ keys.transpose(-1, -2)  # [..., nb (key block), C, sub]
    scores = cross.movedim(-3, -2).reshape(*lead, C, C)
    # The cross term is zero on the diagonal blocks; add the exact in-block scores there.
    blocks = torch.diagonal(scores.view(*lead, nb, sub, nb, sub), dim1=-4, dim2=-2)  # [..., sub, sub, nb]
    blocks.add_(diag.movedim(-3, -1))
    return scores


def kda_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor,
    scale: float,
    chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """Chunkwise-parallel KDA (prefill) over one sequence or a batch of equal-length ones.

    Same shapes as :func:`kda_naive`, optionally with a leading batch dim on every
    argument (q [S, T, H, K], initial_state [S, H, K, V], ...).  Any length works:
    the tail is padded with k = v = q = 0, beta = 0, g = 0, which leaves the state
    untouched; that is also how a caller pads shorter sequences of a batch.
    """
    if q.dim() == 3:
        o, final = kda_chunked(
            q[None], k[None], v[None], g[None], beta[None], initial_state[None], scale, chunk_size
        )
        return o[0], final[0]
    B, T, H, K = k.shape
    V = v.shape[-1]
    # A sequence shorter than a chunk gets a shorter chunk (whole sub-chunks): the
    # result is the same, without the intra-chunk work on padding.
    C = min(chunk_size, -(-T // SUB_CHUNK) * SUB_CHUNK)
    pad = (-T) % C
    N = (T + pad) // C

    def to_chunks(x: Tensor) -> Tensor:  # [B, T, H, D] -> [B, H, N, C, D]
        x = F.pad(x, (0, 0, 0, 0, 0, pad))
        return x.view(B, N, C, H, x.shape[-1]).permute(0, 3, 1, 2, 4)

    q_c, k_c, v_c, g_c = to_chunks(q * scale), to_chunks(k), to_chunks(v), to_chunks(g)
    beta_c = to_chunks(beta.unsqueeze(-1))  # [B, H, N, C, 1]

    # ---- state-independent part, all chunks at once
    G = g_c.cumsum(-2)  # [B, H, N, C, K]
    decay_in = G.exp()  # e^{G_t}: decay from the chunk start, <= 1
    q_in, k_in = q_c * decay_in, k_c * decay_in
    if _chunk_factorable(G):
        # Usual case: e^{G_t - G_i} = e^{G_t} e^{-G_i} cannot overflow, so the
        # intra-chunk scores are two matmuls sharing the decayed keys.
        k_inv = (k_c * torch.exp(-G)).transpose(-1, -2)
        strict = torch.ones(C, C, dtype=torch.bool, device=G.device).tril(-1)
        A = (k_in @ k_inv).masked_fill_(~strict, 0.0) * beta_c
        P = (q_in @ k_inv).masked_fill_(~strict.logical_or(torch.eye(C, dtype=torch.bool, device=G.device)), 0.0)
    else:
        A = _decay_scores(k_c, k_c, G, strict=True) * beta_c
        P = _decay_scores(q_c, k_c, G, strict=False)
    rhs = torch.cat([beta_c * k_in, beta_c * v_c], dim=-1)
    eye = torch.eye(C, dtype=A.dtype, device=A.device)
    WU = torch.linalg.solve_triangular(A + eye, rhs, upper=False, unitriangular=True)
    W, U0 = WU.split([K, V], dim=-1)
    G_end = G[..., -1:, :]  # [B, H, N, 1, K]
    k_out = (k_c * torch.exp(G_end - G)).transpose(-1, -2)  # [B, H, N, K, C]: decay to the chunk end
    decay_end = G_end.squeeze(-2).exp().unsqueeze(-1)  # [B, H, N, K, 1]

    # ---- inter-chunk state passing: the only sequential part
    S = initial_state
    out = torch.empty(B, H, N, C, V, dtype=v.dtype, device=v.device)
    for n in range(N):
        U = U0[:, :, n] - W[:, :, n] @ S
        out[:, :, n] = q_in[:, :, n] @ S + P[:, :, n] @ U
        S = decay_end[:, :, n] * S + k_out[:, :, n] @ U
    o = out.reshape(B, H, N * C, V)[:, :, :T].transpose(1, 2)
    return o, S
