"""A decode-only step through the native kernels, one C call per block.

At batch 32 on the two-core bench box a decode step spent about 4.7 ms in the C
kernels and 3 ms in the Python around them: module calls, wrapper checks, small
tensor ops and allocations, 60-odd of each per step.  This path checks the shapes
once (when the model switches to the native kernels), keeps each layer's packed
weights as raw pointers, and runs a layer as seven calls on reused buffers:

    norm -> KDA or attention block -> residual add + norm -> router GEMM
         -> route (top-k, softmax) -> dispatch -> experts -> combine + residual add

(dispatch and combine are the expert-parallel sections, ``ep.dispatch`` / ``ep.combine``,
with the model's ``EPSettings``: see ``refstack.model.moe``).

It takes every decode-only batch (states and KV rows are found by slot); prefill and
mixed steps run the module path.  The trace spans are the module path's (``kda``,
``attention``, ``moe.dispatch``, ``moe.experts``, ``moe.combine``, ``lm_head``), so a
timeline reads the same, and so is the arithmetic: the same kernels in the same
order, bit for bit (tested), so which path a step takes never changes a token.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor

from refstack.kernels import cpu_attention, cpu_blocks, cpu_build, cpu_kernels
from refstack.model import decode_trace
from refstack.model.attention import AttentionLayer
from refstack.model.batch import ForwardBatch
from refstack.model.cache import ModelCache
from refstack.model.config import LM_HEAD_PRECISIONS
from refstack.model.decode_trace import H0_AT, H1_AT, T0_AT, T1_AT
from refstack.model.kda import KDALayer
from refstack.model.moe import MoE

if TYPE_CHECKING:
    from refstack.model.model import HybridModel


@dataclass(frozen=True, slots=True)
class _Layer:
    index: int
    is_kda: bool
    mixer_args: tuple[Any, ...]  # the block's weights and shape, in the C call's order
    mixer_norm: tuple[int, float]  # (weight pointer, eps)
    mlp_norm: tuple[int, float]
    router: int  # packed fp32 router weight
    gate_up: int
    down: int
    experts_bf16: bool
    experts_w8a8: bool = False  # tagged W8A8 packs (refstack.model.quant)


class NativeDecoder:
    """Built by ``HybridModel.use_native_kernels(True)``; holds references to every
    tensor whose pointer it keeps, so none is freed under it.  Work buffers are per
    thread: the C calls release the GIL, and two engines may step one model."""

    def __init__(self, model: HybridModel) -> None:
        cfg = model.config
        self.model = model
        self.lib = cpu_kernels.load()
        self.lib_holding_gil = cpu_build.load_holding_gil()  # the EP section's handle when it keeps the GIL
        self.ep_ranks = cfg.ep_ranks
        self.hidden = cfg.hidden_size
        self.num_experts, self.top_k, self.expert_hidden = cfg.num_experts, cfg.num_experts_per_tok, cfg.expert_hidden_size
        self._keep: list[Tensor] = []  # every tensor a pointer below points into
        self.layers = [self._capture(i, layer) for i, layer in enumerate(model.layers)]
        self.final_norm = self._ptr(model.norm.weight), model.norm.eps
        self.rope = self._ptr(model.rope_cos), self._ptr(model.rope_sin), int(model.rope_cos.shape[0])
        self._scratch_floats = max(self._mixer_scratch(layer) for layer in self.layers)
        self._moes = [m for m in model.modules() if isinstance(m, MoE)]
        self._local = threading.local()
        self.kinds = tuple(layer.is_kda for layer in self.layers)  # the step record's layer kinds
        # The kernels' marks share the trace's clock on Linux; elsewhere the step records
        # model.forward and lm_head only (decode_trace).
        self._marks_on_trace_clock = decode_trace.marks_in_sync_with_perf_counter()

    # ------------------------------------------------------------------ set-up
    def _ptr(self, t: Tensor | None, dtype: torch.dtype | None = None) -> int:
        """t's address, kept alive; ``dtype`` checks a packed weight's type (the kernel
        chosen for it reads that many bytes per element)."""
        if t is None or not t.is_contiguous() or t.device.type != "cpu" or (dtype is not None and t.dtype != dtype):
            raise ValueError(f"native decode: expected a contiguous CPU tensor{f' of {dtype}' if dtype else ''}, got "
                             f"{None if t is None else (t.dtype, tuple(t.shape))}")
        self._keep.append(t)
        return t.data_ptr()

    def _capture(self, index: int, layer: Any) -> _Layer:
        mixer, moe = layer.mixer, layer.moe
        f32 = torch.float32
        if isinstance(mixer, KDALayer):
            H, K, V = mixer.num_heads, mixer.k_dim, mixer.v_dim
            n_in = sum(mixer.split_sizes)
            # One kernel reads all three weights: they must share the pack type.
            wt = mixer.in_proj.packed.dtype if mixer.in_proj.packed is not None else None
            args: tuple[Any, ...] = (
                self._ptr(mixer.in_proj.packed, wt), n_in, self._ptr(mixer.low_rank_packed, wt), self._ptr(mixer.dt_bias, f32),
                self._ptr(mixer.A_log, f32), K**-0.5, 1e-12, H, K, V, mixer.scale, self._ptr(mixer.o_norm.weight, f32),
                mixer.o_norm.eps, self._ptr(mixer.o_proj.packed, wt), cpu_kernels.gemm_kind(wt),
            )
        else:
            assert isinstance(mixer, AttentionLayer)
            wt = mixer.qkv_proj.packed.dtype if mixer.qkv_proj.packed is not None else None
            args = (
                self._ptr(mixer.qkv_proj.packed, wt), self._ptr(mixer.o_proj.packed, wt), cpu_kernels.gemm_kind(wt),
                mixer.num_heads, mixer.num_kv_heads, mixer.head_dim, mixer.head_dim**-0.5,
            )
        if moe.packed is None:
            raise ValueError("native decode: the MoE has no packed experts (use_native_kernels first)")
        et = moe.packed[0].dtype
        return _Layer(
            index=index, is_kda=isinstance(mixer, KDALayer), mixer_args=args,
            mixer_norm=(self._ptr(layer.mixer_norm.weight, f32), layer.mixer_norm.eps),
            mlp_norm=(self._ptr(layer.mlp_norm.weight, f32), layer.mlp_norm.eps),
            router=self._ptr(moe.router.packed, f32), gate_up=self._ptr(moe.packed[0], et), down=self._ptr(moe.packed[1], et),
            experts_bf16=et == torch.bfloat16, experts_w8a8=et == torch.int8,
        )

    @staticmethod
    def _mixer_scratch(layer: _Layer) -> int:
        """Floats of scratch per token the layer's block needs."""
        if layer.is_kda:
            return cpu_blocks.kda_scratch_floats(layer.mixer_args[1], *layer.mixer_args[7:10])
        return cpu_blocks.attn_scratch_floats(*layer.mixer_args[3:6])

    def _buffers_for(self, B: int) -> dict[str, int]:
        """Addresses of this thread's work buffers for a batch of B tokens (a decode batch
        size repeats step after step, so they are kept, with their tensors, for the last size)."""
        cached: dict[int, tuple[dict[str, Tensor], dict[str, int]]] = getattr(self._local, "buffers", {})
        entry = cached.get(B)
        if entry is None:
            D, E, k, inner = self.hidden, self.num_experts, self.top_k, self.expert_hidden
            f32, i64 = torch.float32, torch.int64
            bufs = {
                "h": torch.empty(B, D), "delta": torch.empty(B, D), "router": torch.empty(B, E),
                "ids": torch.empty(B, k, dtype=i64), "w": torch.empty(B, k, dtype=f32),
                "counts": torch.empty(E, dtype=i64), "offsets": torch.empty(E + 1, dtype=i64),
                "rows": torch.empty(B * k, D), "slot": torch.empty(B * k, dtype=i64),
                "token": torch.empty(B * k, dtype=i64), "weights": torch.empty(B * k),
                "hidden": torch.empty(B * k, inner), "expert_out": torch.empty(B * k, D),
                "scratch": torch.empty(B * self._scratch_floats),
            }
            entry = bufs, {name: t.data_ptr() for name, t in bufs.items()}
            self._local.buffers = {B: entry}  # keep one size: batch sizes drift as requests finish
        return entry[1]

    # ------------------------------------------------------------------ the step
    def takes(self, batch: ForwardBatch) -> bool:
        # A forced MoE layout (a test or an experiment on torch's experts) runs the module path.
        # A batch with image embeddings spliced in runs the module path, which splices them.
        return batch.num_decode == batch.num_tokens > 0 and batch.embed_rows is None and all(m.dispatch_layout == "auto" for m in self._moes)

    def forward(self, batch: ForwardBatch, cache: ModelCache) -> Tensor:
        """Next-token logits [B, vocab] for a decode-only batch (distinct slots, any order)."""
        assert self.takes(batch)
        # The spans: the kernels mark each layer's, four clock reads here mark the step's,
        # and one record of integers holds them all (decode_trace); nothing at all when
        # none of their categories is recorded.
        traced = decode_trace.begin(self.lib, self.kinds, batch.num_tokens,
                                    LM_HEAD_PRECISIONS.index(self.model.lm_head.precision),
                                    not self.model.ep.release_gil, log=self._marks_on_trace_clock)
        if traced is None:
            return self.model.lm_head.logits(self._layers(batch, cache, None))
        rec, sink = traced
        v, clock = rec.values, time.perf_counter_ns
        v[T0_AT] = clock()
        try:
            h = self._layers(batch, cache, rec)
            v[H0_AT] = clock()
            logits = self.model.lm_head.logits(h)
            v[H1_AT] = clock()
            return logits
        finally:
            end = v[T1_AT] = clock()
            if v[H0_AT] >= 0 > v[H1_AT]:
                v[H1_AT] = end  # the LM head raised: its span ends with the step, as the module path's would
            sink(v)

    def _layers(self, batch: ForwardBatch, cache: ModelCache, rec: decode_trace.StepRecord | None) -> Tensor:
        """Every layer, then the final norm: the hidden states the LM head takes."""
        lib, B, D = self.lib, batch.num_tokens, self.hidden
        nt = torch.get_num_threads()
        p = self._buffers_for(B)
        slots, positions = batch.decode_slots.contiguous(), batch.decode_positions.contiguous()
        x = F.embedding(batch.token_ids, self.model.embed.weight)  # the residual stream, updated in place
        xp = x.data_ptr()
        layer = self.layers[0]
        try:
            for layer in self.layers:
                self._check(lib.refstack_rms_norm(xp, None, B, D, layer.mixer_norm[0], layer.mixer_norm[1], None, p["h"],
                                                  nt), "rms_norm")
                if layer.is_kda:
                    self._kda(layer, batch, cache, slots, p, nt)
                else:
                    self._attention(layer, batch, cache, slots, positions, p, nt)
                # x += delta; h = norm(x)
                self._check(lib.refstack_rms_norm(xp, p["delta"], B, D, layer.mlp_norm[0], layer.mlp_norm[1], None,
                                                  p["h"], nt), "rms_norm")
                cross = self._moe(layer, B, p, xp, nt)
                if cross and rec is not None:
                    rec.set_cross(layer.index, cross)
        except BaseException:
            if rec is not None:
                rec.drop_layers_from(layer.index)
            raise
        return cpu_kernels.rms_norm(x, self.model.norm.weight, self.model.norm.eps)

    def _kda(self, layer: _Layer, batch: ForwardBatch, cache: ModelCache, slots: Tensor, p: dict[str, int],
             nt: int) -> None:
        B = batch.num_tokens
        states = cache.states[layer.index]
        if batch.fresh_decode_slots is not None:  # a one-token prompt starts from a zero state
            states.index_fill_(0, batch.fresh_decode_slots, 0.0)
        # A bf16 state (kda_state_dtype): the kernel updates fp32 copies of the
        # batch's rows, rounded back into the cache after the step.
        work, rows = (states, slots) if states.dtype == torch.float32 else \
            (states.index_select(0, slots).float(), torch.arange(B))
        a = layer.mixer_args
        self._check(self.lib.refstack_kda_decode_block(
            p["h"], B, self.hidden, a[0], a[1], a[2], a[3], a[4], a[5], a[6], work.data_ptr(), a[7], a[8], a[9], a[10],
            a[11], a[12], a[13], a[14], rows.data_ptr(), p["delta"], p["scratch"], nt), "kda_decode_block")
        if work is not states:
            states.index_copy_(0, slots, work.to(states.dtype))

    def _attention(self, layer: _Layer, batch: ForwardBatch, cache: ModelCache, slots: Tensor, positions: Tensor,
                   p: dict[str, int], nt: int) -> None:
        keys, values = cache.keys[layer.index], cache.values[layer.index]
        # The cache's storage type (fp32, bf16, fp8 e4m3, int8) and scales: the
        # kernel encodes the new rows and widens stored ones as it reads.
        kv = cpu_attention.kv_cache_args("native decode", keys, values, cache.k_scales.get(layer.index),
                                       cache.v_scales.get(layer.index))
        a = layer.mixer_args
        self._check(self.lib.refstack_attn_decode_block_kv(
            p["h"], batch.num_tokens, self.hidden, a[0], a[1], a[2], a[3], a[4], a[5], self.rope[0], self.rope[1],
            self.rope[2], keys.data_ptr(), values.data_ptr(), *kv, slots.data_ptr(), positions.data_ptr(),
            cache.num_slots, keys.shape[2], a[6], p["delta"], p["scratch"], nt), "attn_decode_block")

    def _moe(self, layer: _Layer, B: int, p: dict[str, int], xp: int, nt: int) -> int:
        """The MoE block, its residual add included; the bytes the exchange moved.  Its
        spans come from the kernels' marks (decode_trace)."""
        lib, D, E, k = self.lib, self.hidden, self.num_experts, self.top_k
        self._check(lib.refstack_gemm(p["h"], B, D, D, layer.router, E, p["router"], E, nt), "router gemm")
        self._check(lib.refstack_moe_route(p["router"], B, E, k, p["ids"], p["w"]), "moe_route")
        ep = self.model.ep  # the exchange's GIL and link model (see refstack.model.moe)
        ns = ep.ns_per_byte
        ep_lib = lib if ep.release_gil else self.lib_holding_gil
        cross = lib.refstack_ep_cross_bytes(p["ids"], B, k, E, self.ep_ranks, D) if ns > 0 and self.ep_ranks > 1 else 0
        self._check(ep_lib.refstack_ep_dispatch(p["h"], B, D, p["ids"], p["w"], k, E, p["counts"], p["rows"],
                                                p["slot"], p["token"], p["weights"], p["offsets"], nt, cross, ns),
                    "ep_dispatch")
        experts = lib.refstack_moe_experts_w8a8 if layer.experts_w8a8 else \
            lib.refstack_moe_experts_bf16 if layer.experts_bf16 else lib.refstack_moe_experts
        self._check(experts(p["rows"], p["offsets"], E, D, self.expert_hidden, layer.gate_up, layer.down,
                            p["hidden"], p["expert_out"], nt), "moe_experts")
        # x += sum_j w_j * expert_out[slot_j]: the block's residual add rides along.
        self._check(ep_lib.refstack_ep_combine(p["expert_out"], B * k, p["slot"], p["w"], B, k, D, xp, 1, nt, cross, ns),
                    "ep_combine")
        return cross

    @staticmethod
    def _check(rc: int, kernel: str) -> None:
        # The shapes were checked when the decoder was built and the batch by
        # ForwardBatch; a non-zero code here is a bug or no memory, never bad input.
        if rc == 3:
            raise MemoryError(f"native decode: {kernel} could not allocate its scratch")
        if rc:
            raise RuntimeError(f"native decode: {kernel} returned {rc}")

