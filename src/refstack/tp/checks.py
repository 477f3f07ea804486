"""Which ``--tp`` launches can run: one line naming the knob when one cannot.

Checked before anything is built or spawned, so an impossible launch costs nothing and
reads the same on every machine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refstack.engine.config import EngineConfig

if TYPE_CHECKING:
    from refstack.model.config import HybridConfig


class TPConfigError(ValueError):
    """A tensor-parallel launch that cannot run; the message is one line naming the knob."""


def uses_tp(config: EngineConfig) -> bool:
    """Whether the engine runs the sharded model (any TP degree, or a TP-GEMM precision at --tp 1)."""
    return config.tp > 1 or config.tp_gemm_precision != "fp32"


def tp_problem(config: EngineConfig, *, disagg: bool = False, model: HybridConfig | None = None) -> str | None:
    """Why ``config`` cannot serve tensor-parallel, or None when it can (or does not use TP).
    ``model``: the model's shape (default: the config's preset)."""
    if not uses_tp(config):
        return None
    n = config.tp
    flag = f"--tp {n}" if n > 1 else f"--tp-gemm-precision {config.tp_gemm_precision}"
    if disagg:
        return f"{flag} with --disagg: tensor parallelism runs in the single-engine server only; pass --tp 1 (and --tp-gemm-precision fp32) or --disagg false"
    if config.quantization != "none":
        return f"{flag} with --quantization {config.quantization}: the shards run unquantised projections; pass --quantization none"
    if config.kv_cache_dtype not in ("auto", "fp32") or config.kv_cache_dtype_layers:
        return (f"{flag} with --kv-cache-dtype {config.kv_cache_dtype or 'auto'}"
                f"{' --kv-cache-dtype-layers ' + config.kv_cache_dtype_layers if config.kv_cache_dtype_layers else ''}: "
                "each rank's KV cache is fp32; pass --kv-cache-dtype auto and no --kv-cache-dtype-layers")
    if config.kda_state_dtype != "fp32":
        return f"{flag} with --kda-state-dtype {config.kda_state_dtype}: each rank's KDA state is fp32; pass --kda-state-dtype fp32"
    if config.cpu_kernels == "native":
        return f"{flag} with --cpu-kernels native: the shards run torch's kernels; pass --cpu-kernels torch or auto"
    if config.kda_decode_kernel != "torch":
        return (f"{flag} with --kda-decode-kernel {config.kda_decode_kernel}: the shards run torch's KDA decode; "
                "pass --kda-decode-kernel torch")
    if model is None:
        from refstack.model.config import (
            HybridConfig as _Config,  # (the model package imports torch)
        )

        model = _Config.preset(config.preset)
    parts = {"KDA heads": model.kda_num_heads, "attention heads": model.num_heads, "KV heads": model.num_kv_heads,
             "experts": model.num_experts, "vocabulary entries": model.vocab_size}
    for what, size in parts.items():
        if size % n:
            divisors = [d for d in range(1, max(parts.values()) + 1) if all(v % d == 0 for v in parts.values())]
            return (f"{flag}: the {config.preset} preset's {size} {what} do not split over {n} ranks (each rank "
                    f"holds an equal share); pass --tp in {divisors}")
    return None


def check_tp(config: EngineConfig, *, disagg: bool = False) -> None:
    problem = tp_problem(config, disagg=disagg)
    if problem:
        raise TPConfigError(problem)
