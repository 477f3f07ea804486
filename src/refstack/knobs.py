"""Every launch flag of ``refstack serve`` as a typed knob.

A knob has a name, a type, a domain (min/max or choices), a default, the components it
affects and a help line.  A numeric domain also says how a search should spread its
values (``scale``: log when it spans 64x or more from a positive min), the range a user
would try first (``typical``) and what it consumes of the machine (``resource: threads``
for a thread count, with ``per_process``, the processes that take it each), so a tuner
neither samples 448 torch threads on a 2-core box nor a step budget of 20 tokens.  The CLI builds its options from this list, and
``refstack knobs --json`` prints it, so an agent reads the same domains the server
enforces.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refstack.engine.config import (
    CPU_KERNELS,
    DEVICES,
    DTYPES,
    KDA_DECODE_KERNELS,
    KDA_STATE_DTYPES,
    KV_CACHE_DTYPES,
    KV_TRANSFER_GRANULARITIES,
    LM_HEAD_PRECISIONS,
    QUANTIZATIONS,
    TP_GEMM_PRECISIONS,
    TRACE_LEVELS,
    EngineConfig,
)

PRESETS: tuple[str, ...] = ("tiny", "small")
DISAGG_MODES: tuple[str, ...] = ("false", "true", "epd")
LOG_LEVELS: tuple[str, ...] = ("critical", "error", "warning", "info", "debug")
LOG_RATIO = 64  # the span (max/min, from a positive min) above which a domain is searched on a log scale
_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def _fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class KnobError(ValueError):
    """A knob value outside its type or domain; the message is one line a person can act on."""


@dataclass(frozen=True, slots=True)
class Knob:
    name: str
    type: str  # "int" | "float" | "str" | "bool" | "choice"
    default: Any
    components: tuple[str, ...]
    help: str
    min: float | None = None
    max: float | None = None
    choices: tuple[str, ...] = ()
    # The search space of a numeric knob (see the module docstring).
    typical: tuple[float, float] | None = None
    resource: str | None = None  # "threads" (or "memory_gib" / "memory_mib")
    per_process: int = 1
    # Meant to change what the model answers (its weights, a precision, a quantisation):
    # the listing says so, and a harness need not hold a change of it to the same greedy text.
    changes_outputs: bool = False

    def __post_init__(self) -> None:
        if self.typical is not None:
            assert self.min is not None and self.max is not None and self.min <= self.typical[0] <= self.typical[1] <= self.max, self
        assert self.resource in (None, "threads", "memory_gib", "memory_mib") and self.per_process >= 1, self

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def scale(self) -> str | None:
        """``log`` or ``linear`` for a bounded numeric knob (None for the others)."""
        if self.type not in ("int", "float") or self.min is None or self.max is None:
            return None
        return "log" if self.min > 0 and self.max / self.min >= LOG_RATIO else "linear"

    def domain(self) -> dict[str, Any]:
        if self.type == "choice":
            return {"choices": list(self.choices)}
        if self.type == "bool":
            return {"choices": [True, False]}
        if self.min is None and self.max is None:
            return {}
        out: dict[str, Any] = {"min": self.min, "max": self.max}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.typical is not None:
            out["typical"] = list(self.typical)
        if self.resource is not None:
            out.update(resource=self.resource, per_process=self.per_process)
        return out

    def describe_search(self) -> str:
        """``log; typical [4, 256]; threads x 1 process`` (empty for a knob no search spreads)."""
        parts = [p for p in (self.scale,) if p]
        if self.typical is not None:
            parts.append(f"typical [{_fmt(self.typical[0])}, {_fmt(self.typical[1])}]")
        if self.resource is not None:
            parts.append(f"{self.resource} x {self.per_process} process{'es' if self.per_process != 1 else ''}")
        return "; ".join(parts)

    def describe_domain(self) -> str:
        if self.type in ("choice", "bool"):
            return "|".join(str(c).lower() for c in self.domain()["choices"])
        if self.min is None and self.max is None:
            return self.type
        return f"{self.type} in [{self.min}, {self.max}]"

    def parse(self, raw: Any) -> Any:
        """The typed value of ``raw`` (a flag's string or an already typed value)."""
        where = f"expected {self.describe_domain()}, got {raw!r}"
        if self.type == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise KnobError(where)
        if self.type == "choice":
            if isinstance(raw, bool):  # a YAML or JSON bool for a choice spelled "true" / "false" (--disagg)
                raw = str(raw).lower()
            if str(raw) not in self.choices:
                raise KnobError(where)
            return str(raw)
        if self.type == "str":
            return str(raw)
        try:
            value: int | float = int(str(raw)) if self.type == "int" else float(str(raw))
        except ValueError:
            raise KnobError(where) from None
        if value != value or (self.min is not None and value < self.min) or (self.max is not None and value > self.max):
            raise KnobError(where)  # NaN fails every range
        return value

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.name, "flag": self.flag, "type": self.type, "domain": self.domain(),
               "default": self.default, "components": list(self.components), "help": self.help}
        if self.changes_outputs:
            out["changes_outputs"] = True
        return out


KNOBS: tuple[Knob, ...] = (
    Knob("preset", "choice", "tiny", ("model",), "Model size preset (seeded random weights).", choices=PRESETS, changes_outputs=True),
    Knob("host", "str", "127.0.0.1", ("server",), "Address to bind; loopback by default."),
    Knob("port", "int", 0, ("server",), "TCP port; 0 takes a free port (the URL is printed).", min=0, max=65535),
    Knob("max_running", "int", 32, ("engine.scheduler",),
         "Most requests running at once (each holds a cache slot).", min=1, max=4096, typical=(4, 256)),
    Knob("max_batch_tokens", "int", 512, ("engine.scheduler", "model"),
         "Token budget of one engine step: decode tokens plus prefill chunks.", min=1, max=65536, typical=(64, 8192)),
    Knob("prefill_chunk", "int", 256, ("engine.scheduler", "model"),
         "Longest prefill piece one request gets per step (chunked prefill).", min=1, max=65536, typical=(32, 2048)),
    Knob("fuse_prefill_decode", "bool", False, ("engine.scheduler", "model"),
         "Run a step's decodes and prefill chunks in one forward pass instead of two (fewer passes "
         "over the weights; the trace then shows such steps as 'prefill' with a decode_batch arg)."),
    Knob("max_waiting", "int", 256, ("engine.scheduler", "server"),
         "Queue cap: beyond it new requests get HTTP 503 with Retry-After.  Every request waits "
         "at least until the next step, so the cap is at least 1.", min=1, max=1_000_000, typical=(16, 4096)),
    Knob("num_slots", "int", 0, ("engine.cache",),
         "Cache slots (KV rows + KDA state); 0 means one per max_running.", min=0, max=4096),
    Knob("max_seq_len", "int", 0, ("engine.cache", "model"),
         "Context length (prompt + completion); 0 takes the preset's.", min=0, max=65536),
    Knob("seed", "int", 0, ("model", "engine.sampler"),
         "Seeds the model weights and the sampling of requests without a seed.", min=0, max=2**31 - 1, changes_outputs=True),
    Knob("lm_head_precision", "choice", "fp32", ("model.lm_head",),
         "Arithmetic precision of the LM head GEMM (passed into HybridConfig).", choices=LM_HEAD_PRECISIONS, changes_outputs=True),
    Knob("dtype", "choice", "auto", ("model.linear", "model.moe", "model.kda", "model.attention"),
         "Operand type of the model's GEMMs (projections, experts): float32, or bfloat16 (weights rounded to bf16, "
         "each GEMM's input rows rounded to bf16, fp32 accumulation; the residual stream, norms, router, KDA state, "
         "attention, KV cache and LM head stay fp32).  'auto': bfloat16 when the native kernels run on a CPU with a "
         "bf16 dot product (AVX512_BF16), float32 otherwise; GET /debug/engine shows the choice.", choices=DTYPES, changes_outputs=True),
    Knob("torch_threads", "int", 0, ("runtime",),
         "torch intra-op threads for the engine; 0 keeps torch's default.", min=0, max=1024, resource="threads"),
    Knob("cpu_kernels", "choice", "auto", ("model.linear", "model.norm", "model.moe", "model.kda", "model.attention"),
         "Kernels of the model's hot path (Linears, norms, MoE, KDA recurrence, decode attention): 'native' "
         "kernels (fp32 or bf16, per dtype) built with the C compiler on first use, 'torch' (MKL and tensor ops), or 'auto' (native when it "
         "builds).", choices=CPU_KERNELS),
    Knob("device", "choice", "cpu", ("model", "engine.cache", "engine.sampler"),
         "Where the model's weights, the KV / KDA state cache and each step's tensors live: 'cpu', 'cuda' (refused "
         "when no CUDA device is visible) or 'auto' (cuda when torch sees one, else cpu; logged once).  On cuda the "
         "native CPU kernels are off (--cpu-kernels auto means torch, native is refused); sampling stays on the CPU "
         "with each request's CPU generator (one copy of the step's logits per step).",
         choices=DEVICES),
    Knob("kda_decode_kernel", "choice", "torch", ("model.kda",),
         "What runs the KDA layers' decode step on torch's path: 'torch' (the recurrent step in tensor ops) or "
         "'triton' (refstack.kernels.kda_decode, one fused kernel; needs --device cuda, or TRITON_INTERPRET=1 on the "
         "CPU, and makes --cpu-kernels auto mean torch).  Prefill stays on torch's chunked path.",
         choices=KDA_DECODE_KERNELS),
    Knob("quantization", "choice", "none", ("model.linear", "model.moe", "model.kda", "model.attention"),
         "Weight/activation quantisation of the Linears of attention, the KDA projections and the experts: 'none', "
         "or 'w8a8' (int8 weights per output channel, int8 activations per token after SmoothQuant smoothing "
         "calibrated on a seeded prompt set at load).  The router, norms, KDA recurrence and LM head stay in "
         "higher precision.", choices=QUANTIZATIONS, changes_outputs=True),
    Knob("kv_cache_dtype", "choice", "auto", ("engine.cache", "model.attention"),
         "Storage type of the attention KV cache: 'auto' (fp32, the model's), 'fp32', 'bf16', 'fp8_e4m3' or "
         "'int8' (both with a scale per (layer, head)).  Bytes per token and the sequences that fit are shown at "
         "startup and in GET /debug/engine.", choices=KV_CACHE_DTYPES, changes_outputs=True),
    Knob("kv_cache_dtype_layers", "str", "", ("engine.cache", "model.attention"),
         "Per-layer override of --kv-cache-dtype (a mixed cache): 'LAYER:DTYPE,...', e.g. '1:bf16,3:int8'; "
         "LAYER is the model's layer index and must be an attention layer (1 and 3 in tiny).", changes_outputs=True),
    Knob("kda_state_dtype", "choice", "fp32", ("engine.cache", "model.kda"),
         "Storage type of the KDA recurrent state: 'fp32' or 'bf16' (half the state bytes; the recurrence "
         "re-rounds it every step, so its error compounds: see docs/refstack.md).", choices=KDA_STATE_DTYPES),
    Knob("step_delay_ms", "float", 0.0, ("engine.loop",),
         "CALIBRATION knob: sleep this long in every engine step.  Benchmarks use it to inject a "
         "slowdown of known size and check that their measurements detect it; leave 0 otherwise.",
         min=0.0, max=60_000.0),
    Knob("step_slowdown", "float", 0.0, ("engine.loop",),
         "CALIBRATION knob: every engine step busy-waits so that steps per second drop by this "
         "fraction under steady load (0.05 = 5% lower throughput); leave 0 otherwise.",
         min=0.0, max=0.9),
    Knob("ep_release_gil", "bool", True, ("model.moe", "runtime"),
         "Expert-parallel dispatch/combine: the native section (token shuffle, then a wait for the peer ranks) "
         "releases the GIL (true) or holds it while it works and waits (false, as an EP library that never drops "
         "it), so other Python threads of the process (the KV transfer thread) cannot run meanwhile."),
    Knob("gc_freeze", "bool", True, ("runtime.gc",),
         "After the engine is built, collect once and freeze every live object (gc.freeze, as vLLM does at "
         "startup), so the cyclic collector's full collections no longer walk the model's and the imports' "
         "objects; false leaves the collector alone (full collections then stall a step for ~100 ms on small)."),
    Knob("ep_link_gbps", "float", 0.0, ("model.moe",),
         "Modelled link bandwidth (GB/s) of the expert-parallel exchange: dispatch and combine each wait "
         "(bytes of token rows crossing ranks) / bandwidth in native code, at most 50 ms; 0 = no wait (all ranks "
         "share the process).", min=0.0, max=1e6),
    Knob("disagg", "choice", "false", ("server", "engine"),
         "Disaggregated serving: 'true' runs a prefill worker and a decode worker process behind this server, the "
         "KV pages and KDA state of each prefilled request moved to the decode worker through a KV store process; "
         "'epd' adds --encode-workers encode worker processes, whose image embeddings reach the prefill worker "
         "through the KV store (images are then never encoded on the prefill engine's thread).",
         choices=DISAGG_MODES),
    Knob("encode_workers", "int", 1, ("engine.encode", "runtime"),
         "With --disagg epd: encode worker processes (one torch thread each); an image goes to the worker its "
         "content hash picks, so its encoder cache hits.", min=1, max=64, typical=(1, 4), resource="threads"),
    Knob("encode_batch_size", "int", 8, ("engine.encode",),
         "Most images one encoder forward takes (inline: the images admitted in one step; epd: the images an "
         "encode worker has queued).", min=1, max=1024, typical=(1, 32)),
    Knob("encode_cache_size", "int", 256, ("engine.encode",),
         "Encoder cache: embeddings of this many images kept by content hash (per encode worker under --disagg "
         "epd), so an image sent again is not encoded again; 0 turns it off.", min=0, max=1_000_000,
         typical=(0, 4096)),
    Knob("kv_transfer", "bool", True, ("engine.kv_transfer",),
         "With --disagg: the prefill worker's 'kv-transfer' thread packs and pushes each request's KV pages "
         "page by page while the model computes the next prefill (true), or none runs and the engine thread puts "
         "each request's KV in one bulk message after its batch (false; the baseline of the 5% prefill criterion)."),
    Knob("kv_page_tokens", "int", 16, ("engine.kv_transfer",),
         "With --disagg: token positions per attention KV page (one page per KV head) the transfer thread packs and pushes.",
         min=1, max=4096, typical=(2, 256)),
    Knob("kv_transfer_granularity", "choice", "request", ("engine.kv_transfer",),
         "With --disagg: when a prefilled request's KV leaves for the KV store: 'request' (after its whole prefill; "
         "the prefill worker then waits for the link before its next step when --kv-transfer is false) or 'layer' "
         "(layer i's KV and KDA state leave while layer i+1 computes, as a layer-wise connector does; the decode side "
         "starts when every layer has arrived).", choices=KV_TRANSFER_GRANULARITIES),
    Knob("kv_link_gbps", "float", 0.0, ("engine.kv_transfer",),
         "CALIBRATION knob, with --disagg: modelled bandwidth (GB/s) of the prefill worker's link to the KV store; "
         "each message holds the link (thread 'kv-link') for bytes / bandwidth.  0 = no modelled wire time "
         "(the Unix socket's own speed).", min=0.0, max=1e6, typical=(0.01, 100.0)),
    Knob("kv_link_compute_ratio", "float", 0.0, ("engine.kv_transfer",),
         "CALIBRATION knob, with --disagg: a modelled link as fast as the prefill compute, whatever the machine: "
         "each message holds the link this many times the forward time its bytes took to make (the running "
         "ratio of the prefill forward's seconds to the KV bytes it posted).  > 0 overrides --kv-link-gbps; "
         "0 = off.", min=0.0, max=100.0, typical=(0.1, 4.0)),
    Knob("tp", "int", 1, ("runtime", "model", "engine.cache"),
         "Tensor parallelism: ranks (processes, torch.distributed: gloo on the CPU, NCCL on GPUs) behind this "
         "server; 1 is the single-process engine.  KDA and attention are split over heads (o_proj row-parallel, "
         "all-reduced), the experts over ranks, the LM head over the vocabulary (gathered).  Must divide the "
         "preset's KDA heads, KV heads, experts and vocabulary; the ranks run torch's kernels (--dtype auto means "
         "float32) with --torch-threads each (0: an equal share of the CPUs).", min=1, max=64),
    Knob("tp_gemm_precision", "choice", "fp32", ("model.kda", "model.attention"),
         "Arithmetic of the tensor-parallel projection GEMMs on every rank (KDA / attention input projections and "
         "the row-parallel o_proj): fp32, tf32, 3xtf32 or bf16 (refstack.kernels.precision).",
         choices=TP_GEMM_PRECISIONS),
    Knob("trace", "bool", False, ("observability.tracing",),
         "Record spans in memory for GET /debug/trace (INFRA_AGENT_TRACE=path also writes a file at exit)."),
    Knob("trace_level", "choice", "step", ("observability.tracing",),
         "Which spans --trace records: step (the default: the engine step, its phases and their shapes, HTTP, "
         "KV transfer and GC spans; cheap enough to leave on, docs/performance.md) or layer (also the per-layer "
         "KDA, attention, MoE and expert-parallel spans: the timeline probe's diagnostic level, which its EP and "
         "GIL findings need).  A tracer already on through INFRA_AGENT_TRACE keeps INFRA_AGENT_TRACE_LEVEL.", choices=TRACE_LEVELS),
    Knob("log_level", "choice", "warning", ("server",), "uvicorn log level.", choices=LOG_LEVELS),
    Knob("max_request_bytes", "int", 1 << 20, ("server",),
         "Largest request body in bytes; a bigger one gets HTTP 413 before it is read (a declared "
         "Content-Length at once, a chunked body once its bytes cross the cap).  The 1 MiB default holds "
         "any prompt that fits the largest context (65,536 tokens), even as fully escaped JSON.",
         min=1024, max=1 << 30),
)

_SERVER_ONLY = ("host", "port", "log_level", "max_request_bytes", "disagg")


def knob(name: str) -> Knob:
    for k in KNOBS:
        if k.name == name:
            return k
    raise KnobError(f"unknown knob {name!r}; known: {', '.join(k.name for k in KNOBS)}")


def parse_knobs(raw: dict[str, Any]) -> dict[str, Any]:
    """Typed values for every knob: the given ones parsed, the rest at their defaults."""
    unknown = sorted(set(raw) - {k.name for k in KNOBS})
    if unknown:
        raise KnobError(f"unknown knob(s) {unknown}")
    values = {}
    for k in KNOBS:
        try:
            values[k.name] = k.parse(raw[k.name]) if raw.get(k.name) is not None else k.default
        except KnobError as exc:
            raise KnobError(f"{k.flag}: {exc}") from None
    return values


def engine_config(values: dict[str, Any]) -> EngineConfig:
    """The engine's share of the knob values (the server-only ones are left out)."""
    return EngineConfig(**{k: v for k, v in values.items() if k not in _SERVER_ONLY})
