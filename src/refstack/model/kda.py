"""The KDA (Kimi Delta Attention) layer: projections around the gated delta rule."""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from infra_agent import tracing
from refstack.kernels import cpu_kda, cpu_kernels
from refstack.model.batch import ForwardBatch, PaddedPrefill
from refstack.model.cache import ModelCache
from refstack.model.config import HybridConfig
from refstack.model.kda_ops import kda_chunked, kda_recurrent_step
from refstack.model.layers import Linear, RMSNorm, round_bf16, seeded_weight


class KDALayer(nn.Module):
    """Linear attention with a per-channel decayed delta-rule state ``[H, K, V]``.

    - q, k: projections, L2-normalised per head (keeps the delta rule contractive);
    - decay ``g = -exp(A_log) * softplus(f + dt_bias)`` per head and K channel, with
      ``f`` a low-rank projection of x;
    - ``beta = sigmoid(b)`` per head, the delta rule's step size;
    - output: per-head RMSNorm, a sigmoid gate (low-rank projection of x), o_proj.
    """

    l2_weight: Tensor

    def __init__(self, config: HybridConfig, layer: int, gen: torch.Generator) -> None:
        super().__init__()
        H, K, V = config.kda_num_heads, config.kda_head_k_dim, config.kda_head_v_dim
        self.layer = layer
        self.num_heads, self.k_dim, self.v_dim = H, K, V
        self.chunk_size = config.kda_chunk_size
        self.scale = K**-0.5
        self.rank = rank = V  # the low-rank bottleneck of the decay and gate projections
        # One fused input projection: q|k, v, beta, decay-rank|gate-rank. Decode is
        # dominated by per-op overhead at small batch, so fewer, larger matmuls win.
        self.split_sizes = [2 * H * K, H * V, H, 2 * rank]
        self.in_proj = Linear(config.hidden_size, sum(self.split_sizes), gen)
        # Both low-rank up-projections as one block-diagonal matmul (decay: rank -> H*K,
        # gate: rank -> H*V); the zero blocks cost a few extra FLOPs but save an op.
        # The decay block has a small scale so the random model keeps a memory of tens
        # of tokens instead of forgetting everything every step.
        up = torch.zeros(H * K + H * V, 2 * rank)
        up[: H * K, :rank] = seeded_weight(gen, H * K, rank, std=0.5 / math.sqrt(rank))
        up[H * K :, rank:] = seeded_weight(gen, H * V, rank, std=1.0 / math.sqrt(rank))
        self.low_rank_up = nn.Parameter(up, requires_grad=False)
        # A in [1, 8] and softplus(dt_bias) in [1e-3, 1e-1], log-uniform as in Mamba.
        a = 1.0 + 7.0 * torch.rand(H, generator=gen)
        self.A_log = nn.Parameter(a.log(), requires_grad=False)
        dt = torch.exp(torch.empty(H * K).uniform_(math.log(1e-3), math.log(1e-1), generator=gen))
        dt_bias = dt + torch.log(-torch.expm1(-dt))  # softplus^-1(dt)
        # dt_bias rides on the up-projection's addmm; the gate part has no bias.
        self.low_rank_bias = nn.Parameter(torch.cat([dt_bias, torch.zeros(H * V)]), requires_grad=False)
        self.native = False  # see use_native
        self.decode_kernel: Callable[..., Tensor] | None = None  # see use_decode_kernel
        self.bf16 = False  # see round_to_bf16
        self.low_rank_packed: Tensor | None = None
        # rms_norm with a constant K^-1/2 weight is an L2 normalisation in one fused op.
        self.register_buffer("l2_weight", torch.full((K,), K**-0.5), persistent=False)
        self.o_norm = RMSNorm(V, config.rms_eps, gen)
        self.o_proj = Linear(H * V, config.hidden_size, gen, scale=1.0 / math.sqrt(2 * config.num_layers))

    def round_to_bf16(self) -> None:
        """The low-rank up-projection as a bf16 GEMM (the Linears round themselves)."""
        self.low_rank_up.copy_(round_bf16(self.low_rank_up))
        self.bf16 = True

    def use_native(self, on: bool) -> None:
        """The low-rank up-projection, the q/k and output norms and the recurrence (decode
        and prefill, see ``cpu_kda.kda_scan_varlen``) through the native kernels (the
        Linears and o_norm switch themselves)."""
        self.native = on
        dtype = torch.bfloat16 if self.bf16 else torch.float32
        # W8A8 projections (refstack.model.quant): this stays fp32 / bf16, behind the tagged
        # header the decode block's one weight kind needs.
        self.low_rank_packed = cpu_kernels.pack(self.low_rank_up.t(), dtype, tagged=self.in_proj.w8a8 is not None) \
            if on else None

    def use_decode_kernel(self, kernel: str) -> None:
        """The decode rows' recurrence on torch's path: "torch" (``kda_recurrent_step``) or
        "triton" (``refstack.kernels.kda_decode``, imported here so that Triton loads only
        when chosen).  The native path (``use_native``) runs its own kernel either way."""
        if kernel not in ("torch", "triton"):
            raise ValueError(f"KDALayer.use_decode_kernel: expected 'torch' or 'triton', got {kernel!r}")
        module: Any = importlib.import_module("refstack.kernels.kda_decode") if kernel == "triton" else None
        self.decode_kernel = module.kda_decode if module is not None else None

    @property
    def dt_bias(self) -> Tensor:
        return self.low_rank_bias[: self.num_heads * self.k_dim]

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """x [T, hidden] -> q, k, g [T, H, K]; v [T, H, V]; beta [T, H]; gate [T, H, V]."""
        T = x.shape[0]
        H, K, V = self.num_heads, self.k_dim, self.v_dim
        if self.native:
            proj = self.in_proj(x)
            assert self.low_rank_packed is not None
            # No bias add here: dt_bias goes into the decay inside kda_prepare, and the
            # gate's part of the bias is zero.
            up = cpu_kernels.gemm(proj[:, -self.split_sizes[-1] :], self.low_rank_packed, self.low_rank_up.shape[0])
            q, k, v, g, beta = cpu_kda.kda_prepare(proj, up, self.dt_bias, self.A_log, H, K, V, K**-0.5, 1e-12)
            return q, k, v, g, beta, up[:, H * K :].view(T, H, V)
        qk, v, b, f, gate = self._raw_projections(x)
        q, k, g, beta = self._gates(qk, f, b)
        return q, k, v, g, beta, gate

    def _raw_projections(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """Torch's path, before any activation: qk [T, 2H, K] (q heads, then k heads), v [T, H, V],
        the beta logit b [T, H], the decay pre-activation f [T, H, K] (dt_bias included), gate [T, H, V]."""
        T = x.shape[0]
        H, K, V = self.num_heads, self.k_dim, self.v_dim
        qk, v, b, low = self.in_proj(x).split(self.split_sizes, dim=-1)
        up = F.linear(round_bf16(low) if self.bf16 else low, self.low_rank_up, self.low_rank_bias)
        f, gate = up.split([H * K, H * V], dim=-1)
        return qk.reshape(T, 2 * H, K), v.reshape(T, H, V), b, f.reshape(T, H, K), gate.reshape(T, H, V)

    def _gates(self, qk: Tensor, f: Tensor, b: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """q, k (L2-normalised), the log decay g and beta from the raw projections."""
        # q and k are adjacent in the fused projection: one normalisation for both.
        q, k = F.rms_norm(qk, (self.k_dim,), self.l2_weight, 1e-12).split(self.num_heads, dim=1)
        g = F.softplus(f) * torch.exp(self.A_log).neg_().view(self.num_heads, 1)
        return q, k, g, torch.sigmoid(b)

    def forward(self, x: Tensor, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        with tracing.span("kda", cat="kda", layer=self.layer, tokens=batch.num_tokens):
            states = cache.states[self.layer]
            if self.native:
                q, k, v, g, beta, gate = self.project(x)
                # Decode tokens and prefill chunks alike, token by token from each slot's
                # state, in one call: no padding, no gathered states.
                seqs = batch.sequences()
                if states.dtype == torch.float32:
                    o = cpu_kda.kda_scan_varlen(q, k, v, g, beta, states, seqs.begins, seqs.lengths, seqs.slots,
                                                    seqs.fresh, self.scale)
                else:  # a bf16 state: the step's rows in fp32, rounded back once the call is done
                    work = states.index_select(0, seqs.slots).float()
                    o = cpu_kda.kda_scan_varlen(q, k, v, g, beta, work, seqs.begins, seqs.lengths,
                                                    torch.arange(len(seqs.slots)), seqs.fresh, self.scale)
                    states.index_copy_(0, seqs.slots, work.to(states.dtype))
                o = cpu_kernels.rms_norm(o, self.o_norm.weight, self.o_norm.eps, gate=gate)
                return self.o_proj(o.flatten(1))
            qk, v, b, f, gate = self._raw_projections(x)
            nd = batch.num_decode
            decoded = None
            if self.decode_kernel is not None and nd:
                decoded = self._decode_kernel(qk[:nd], v[:nd], b[:nd], f[:nd], batch, states)
            if decoded is not None and nd == x.shape[0]:
                o = decoded  # a decode-only step needs none of the torch path's activations
            else:
                q, k, g, beta = self._gates(qk, f, b)
                o = self._torch_core(q, k, v, g, beta, batch, states, decoded)
            o = self.o_norm(o) * torch.sigmoid(gate)
            return self.o_proj(o.flatten(1))

    def _torch_core(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, batch: ForwardBatch,
                    states: Tensor, decoded: Tensor | None = None) -> Tensor:
        """The reference: recurrent decode, chunked prefill (padded into one batch when worth it).
        ``decoded``: the decode rows' output, already computed by the decode kernel."""
        nd = batch.num_decode
        parts: list[Tensor] = []
        if decoded is not None:
            parts.append(decoded)
        elif nd:
            parts.append(self._decode(q[:nd], k[:nd], v[:nd], g[:nd], beta[:nd], batch, states))
        if batch.padded_prefill is not None:
            parts.append(self._prefill_padded(q, k, v, g, beta, batch.padded_prefill, states))
        else:
            for span in batch.prefills:
                s = slice(span.begin, span.end)
                # start_pos 0 starts from zero whatever the slot held before.
                init = states[span.slot].float() if span.start_pos > 0 else q.new_zeros(states.shape[1:])
                o, final = kda_chunked(q[s], k[s], v[s], g[s], beta[s], init, self.scale, self.chunk_size)
                states[span.slot] = final  # (rounded to the state's dtype)
                parts.append(o)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode_kernel(self, qk: Tensor, v: Tensor, b: Tensor, f: Tensor, batch: ForwardBatch,
                       states: Tensor) -> Tensor:
        """The decode rows through the chosen kernel, from the raw projections: it normalises
        q and k, applies the decay and beta activations and updates the slots' states in place."""
        assert self.decode_kernel is not None
        # A decode at position 0 (a one-token prompt) must not see a stale state.
        if batch.fresh_decode_slots is not None:
            states.index_fill_(0, batch.fresh_decode_slots, 0.0)
        q, k = qk.split(self.num_heads, dim=1)
        K = self.k_dim
        # A bf16 state: the kernel updates fp32 copies of the rows, rounded back after.
        work, rows = (states, batch.decode_slots) if states.dtype == torch.float32 else \
            (states.index_select(0, batch.decode_slots).float(), torch.arange(qk.shape[0], device=states.device))
        # rms_norm(x, weight=K^-1/2, eps=1e-12) == x / sqrt(sum x^2 + K * 1e-12): that eps
        # and scale K^-1/2 make the kernel's L2 normalisation this path's.  dt_bias is
        # already in f (the up-projection's bias), so the kernel adds none.
        o = self.decode_kernel(q.contiguous(), k.contiguous(), v.contiguous(), f.contiguous(), b.contiguous(),
                               work, rows, A_log=self.A_log, dt_bias=None, scale=self.scale, eps=K * 1e-12)
        if work is not states:
            states.index_copy_(0, batch.decode_slots, work.to(states.dtype))
        return o

    def _decode(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, batch: ForwardBatch, states: Tensor
    ) -> Tensor:
        # A decode at position 0 (a one-token prompt) must not see a stale state.
        if batch.fresh_decode_slots is not None:
            states.index_fill_(0, batch.fresh_decode_slots, 0.0)
        if batch.decode_slot_range is not None and states.dtype == torch.float32:
            # Consecutive slots: update the cache's states in place, no gather/scatter.
            lo, hi = batch.decode_slot_range
            return self._step(q, k, v, g, beta, states[lo:hi])
        # (A bf16 state is stepped in fp32 and rounded back to bf16: every step rounds it.)
        state = states.index_select(0, batch.decode_slots).float()
        o = self._step(q, k, v, g, beta, state)
        states.index_copy_(0, batch.decode_slots, state.to(states.dtype))
        return o

    def _step(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> Tensor:
        """One recurrent step, ``state`` (contiguous) updated in place."""
        o, _ = kda_recurrent_step(q, k, v, g, beta, state, self.scale, inplace=True)
        return o

    def _prefill_padded(
        self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, pp: PaddedPrefill, states: Tensor
    ) -> Tensor:
        """All prefill chunks in one batched chunked pass; returns [prefill tokens, H, V]."""
        # Past each chunk's end, k = 0 (no delta update) and g = 0 (no decay) leave its
        # state untouched; q, v, beta there only shape outputs that are dropped.
        keep = pp.valid.to(q.dtype).view(*pp.valid.shape, 1, 1)  # [S, n_max, 1, 1]
        k_p, g_p = k[pp.index] * keep, g[pp.index] * keep
        q_p, v_p, beta_p = q[pp.index], v[pp.index], beta[pp.index]
        init = states.index_select(0, pp.slots).float() * (pp.starts > 0).to(q.dtype).view(-1, 1, 1, 1)
        o, final = kda_chunked(q_p, k_p, v_p, g_p, beta_p, init, self.scale, self.chunk_size)
        states.index_copy_(0, pp.slots, final.to(states.dtype))
        return o[pp.valid_at]
