"""The engine's launch configuration: one frozen dataclass, passed down as an object.

Every field here is a knob (see ``refstack.knobs``); the CLI builds this from the
parsed flags and nothing reads configuration from a global.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from infra_agent.tracing import LEVELS

LM_HEAD_PRECISIONS: tuple[str, ...] = ("fp32", "tf32", "3xtf32", "bf16")
CPU_KERNELS: tuple[str, ...] = ("auto", "native", "torch")
# refstack.model.config.DTYPES plus "auto" (resolve_dtype); spelled out, not imported:
# that would import torch, and `refstack knobs` needs none of it (a test checks the two agree).
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
# Where the model, its caches and each step's tensors live (refstack.engine.device).
DEVICES: tuple[str, ...] = ("cpu", "cuda", "auto")
# What runs the KDA layers' decode step: torch's recurrent step or the Triton kernel.
KDA_DECODE_KERNELS: tuple[str, ...] = ("torch", "triton")
# Weight/activation quantisation of the model's Linears (refstack.model.quant).
QUANTIZATIONS: tuple[str, ...] = ("none", "w8a8")
# Storage type of the attention KV cache ("auto": the model's fp32 cache, as before).
KV_CACHE_DTYPES: tuple[str, ...] = ("auto", "fp32", "bf16", "fp8_e4m3", "int8")
# Storage type of the KDA recurrent state (its own knob: the recurrence reads and
# rewrites it every step, so its rounding compounds).
KDA_STATE_DTYPES: tuple[str, ...] = ("fp32", "bf16")
# infra_agent.tracing's levels: "layer" records every span; "step" only the engine's step,
# its phases and what is not per layer (HTTP, KV transfer, GC), for <= 2% of a step.
TRACE_LEVELS: tuple[str, ...] = tuple(LEVELS)
# Arithmetic of the tensor-parallel shards' projection GEMMs (refstack.tp): the same modes
# as the LM head (refstack.kernels.precision).
TP_GEMM_PRECISIONS: tuple[str, ...] = LM_HEAD_PRECISIONS
# When disaggregated prefill sends a request's KV: after its whole prefill, or each layer's
# while the next layer computes (refstack.disagg.layer_split).
KV_TRANSFER_GRANULARITIES: tuple[str, ...] = ("request", "layer")


def resolve_dtype(dtype: str, cpu_kernels: str) -> str:
    """The model dtype (``HybridConfig.dtype``) a launch with these knobs builds.

    "auto" serves bf16 GEMMs where they are the fast path: the native kernels run and
    the CPU has a bf16 dot product (``vdpbf16ps``), which halves both the weight bytes
    a decode step streams and its FMA count.  Elsewhere it is float32: torch's path
    rounds the operands with extra ops, and the native kernels without the
    instruction widen each bf16 pair to fp32.  (vLLM's ``--dtype auto`` likewise
    serves an fp32 checkpoint in half precision.)
    """
    if dtype != "auto":
        return dtype
    if cpu_kernels == "torch":
        return "float32"
    # Imported here: building the kernels compiles C on first use; `refstack knobs` needs none of it.
    from refstack.kernels import cpu_kernels as kernels

    return "bfloat16" if kernels.bf16_dot_native() else "float32"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What the engine needs to build its model and run its step loop."""

    preset: str = "tiny"
    # Continuous batching limits.
    max_running: int = 32  # requests admitted at once (each holds one cache slot)
    max_batch_tokens: int = 512  # tokens forwarded per engine step (decode + prefill)
    prefill_chunk: int = 256  # longest prefill piece of one request per step
    # Run a step's decode batch and prefill chunks in one forward (one pass over the
    # weights) instead of two; off by default so traces keep the phases apart.
    fuse_prefill_decode: bool = False
    max_waiting: int = 256  # queued requests before new ones are refused (HTTP 503)
    # Cache geometry; 0 means "take it from the model preset / max_running".
    num_slots: int = 0
    max_seq_len: int = 0
    seed: int = 0  # seeds the model weights and unseeded sampling
    lm_head_precision: str = "fp32"
    # The GEMMs' operand type (HybridConfig.dtype): float32, or bf16 weights and inputs
    # with fp32 accumulation (everything between the GEMMs stays fp32); "auto" picks
    # one for this CPU (see resolve_dtype).
    dtype: str = "auto"
    torch_threads: int = 0  # 0 leaves torch's default
    # The model's hot path (Linears, norms, MoE, KDA, decode attention): the native
    # kernels (refstack.kernels.cpu_kernels), torch's ops, or native when it builds ("auto").
    cpu_kernels: str = "auto"
    # Calibration: an added sleep per engine step, so a benchmark can inject a slowdown
    # of known size and check that its measurements see it.
    step_delay_ms: float = 0.0
    # Calibration: each step busy-waits so that steps per second drop by this fraction
    # under steady load (0.05 = 5% lower throughput); see refstack.engine.step_slowdown.
    step_slowdown: float = 0.0
    # Keep spans in memory for /debug/trace even without INFRA_AGENT_TRACE.
    trace: bool = False
    # Which spans --trace records (TRACE_LEVELS).  "step" by default: the level cheap enough
    # to leave on while serving; the per-layer spans ("layer") are the timeline probe's
    # diagnostic level, asked for by name, as vLLM's detailed traces are opt-in.
    trace_level: str = "step"
    # The expert-parallel exchange (refstack.model.moe.EPSettings): its native section
    # releases the GIL (or holds it, as a library that spins with it held), and the
    # modelled link bandwidth its spin-wait stands for (0: no wait).
    ep_release_gil: bool = True
    ep_link_gbps: float = 0.0
    # Move everything alive after the engine is built (the model's modules and tensors,
    # torch's and the server's imports) out of the cyclic collector's reach, as vLLM does
    # after startup: a full collection otherwise walks that whole heap, 80-100 ms on the
    # small preset, and stalls the step it lands in (docs/refstack.md, "GC pauses").
    gc_freeze: bool = True
    # Disaggregated serving (refstack.disagg): whether the prefill worker's transfer
    # thread moves the KV pages (else they move in bulk on the engine thread), and the
    # tokens per attention KV page.  Unused by a single engine.
    kv_transfer: bool = True
    kv_page_tokens: int = 16
    # When a prefilled request's KV leaves: after its whole prefill ("request") or layer by
    # layer while the next layer computes ("layer"); and the modelled bandwidth (GB/s) of the
    # prefill worker's link to the KV store (0: no modelled wire time).  See refstack.disagg.
    kv_transfer_granularity: str = "request"
    kv_link_gbps: float = 0.0
    # Or a wire as fast as the compute (> 0 overrides kv_link_gbps): each message holds the link
    # this many times the forward time its bytes took to make (refstack.disagg.link), so a
    # modelled cluster keeps the same link/compute balance on a fast or a loaded machine.
    kv_link_compute_ratio: float = 0.0
    # "cpu" (the default: nothing changes for existing launches), "cuda" (refused without a
    # visible GPU) or "auto" (cuda when one is visible); resolved with the kernel knobs by
    # refstack.engine.device.resolve_placement.  On cuda the native CPU kernels are off.
    device: str = "cpu"
    # The KDA layers' decode rows: torch's recurrent step, or refstack.kernels.kda_decode
    # (Triton; imported only when chosen).  Prefill stays on torch's chunked path.
    kda_decode_kernel: str = "torch"
    # Quantisation (issue: W8A8 and a mixed-precision KV cache).  ``kv_cache_dtype_layers``
    # overrides the KV cache dtype per attention layer: "LAYER:DTYPE,..." (e.g. "1:bf16,3:int8").
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    kv_cache_dtype_layers: str = ""
    kda_state_dtype: str = "fp32"
    # Tensor parallelism (refstack.tp): ranks (worker processes behind this server; 1 = the
    # single-process engine) and the precision of the sharded projection GEMMs on every rank.
    tp: int = 1
    tp_gemm_precision: str = "fp32"
    # Images (refstack.encode): encode worker processes under --disagg epd, the most images
    # one encoder forward takes, and the encoder cache's size in images (0: no cache).
    encode_workers: int = 1
    encode_batch_size: int = 8
    encode_cache_size: int = 256

    def __post_init__(self) -> None:
        assert self.max_running >= 1, "max_running must be >= 1"
        assert self.max_batch_tokens >= 1, "max_batch_tokens must be >= 1"
        assert self.prefill_chunk >= 1, "prefill_chunk must be >= 1"
        assert self.max_waiting >= 1, "max_waiting must be >= 1"
        assert self.num_slots >= 0 and self.max_seq_len >= 0
        assert self.lm_head_precision in LM_HEAD_PRECISIONS, self.lm_head_precision
        assert self.trace_level in TRACE_LEVELS, self.trace_level
        assert self.step_delay_ms >= 0.0, "step_delay_ms must be >= 0"
        assert 0.0 <= self.step_slowdown <= 0.9, "step_slowdown must be in [0, 0.9]"
        assert self.torch_threads >= 0
        assert self.cpu_kernels in CPU_KERNELS, self.cpu_kernels
        assert self.dtype in DTYPES, self.dtype
        assert self.ep_link_gbps >= 0.0, "ep_link_gbps must be >= 0"
        assert self.kv_page_tokens >= 1, "kv_page_tokens must be >= 1"
        assert self.kv_transfer_granularity in KV_TRANSFER_GRANULARITIES, self.kv_transfer_granularity
        assert self.kv_link_gbps >= 0.0, "kv_link_gbps must be >= 0"
        assert self.kv_link_compute_ratio >= 0.0, "kv_link_compute_ratio must be >= 0"
        assert self.device in DEVICES, self.device
        assert self.kda_decode_kernel in KDA_DECODE_KERNELS, self.kda_decode_kernel
        assert self.quantization in QUANTIZATIONS, self.quantization
        assert self.kv_cache_dtype in KV_CACHE_DTYPES, self.kv_cache_dtype
        assert self.kda_state_dtype in KDA_STATE_DTYPES, self.kda_state_dtype
        assert self.tp >= 1, "tp must be >= 1"
        assert self.tp_gemm_precision in TP_GEMM_PRECISIONS, self.tp_gemm_precision
        assert self.encode_workers >= 1 and self.encode_batch_size >= 1 and self.encode_cache_size >= 0

    @property
    def slots(self) -> int:
        """Cache slots: one per running request unless set explicitly."""
        return self.num_slots or self.max_running

    def with_overrides(self, **overrides: Any) -> EngineConfig:
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
