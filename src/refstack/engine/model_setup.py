"""What an engine serves, made ready from its config: the model, its cache's storage types, and
the token ids it never samples.

``prepare_model`` builds the preset's model (or checks the one given), then applies the
knobs in the one order that works: native kernels are chosen on the CPU before the move to
the device, W8A8 is calibrated and quantised where it will run, and the KDA decode kernel
and the expert-parallel settings come last.  Separate from ``engine`` because it runs once,
before the loop thread exists, and touches nothing of the engine's own state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from refstack.engine.config import EngineConfig, resolve_dtype
from refstack.engine.device import resolve_placement, select_kernels
from refstack.model import HybridConfig, HybridModel

__all__ = ["ServedModel", "cache_storage", "prepare_model", "unsampleable_ids"]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model ready to serve, and what the "auto" knobs became for it."""

    model: Any
    dtype: str  # the model's GEMM operand type
    device: str  # "cpu" or "cuda"
    native_kernels: bool  # whether the native CPU kernels run its matmuls


def prepare_model(config: EngineConfig, model: Any = None) -> ServedModel:
    """The preset's model (or ``model``, checked against ``config.dtype``), placed, on its
    kernels, quantised and configured per ``config``.  Raises ``ValueError`` on a model that
    does not match the config, ``PlacementError`` on knobs this machine cannot run."""
    if model is not None and config.dtype != "auto" and getattr(model.config, "dtype", config.dtype) != config.dtype:
        raise ValueError(f"EngineConfig.dtype={config.dtype!r} but the model given was built with "
                         f"dtype={model.config.dtype!r}; pass dtype='auto' to take the model's")
    placement = resolve_placement(config)
    if model is None:
        overrides: dict[str, Any] = {"lm_head_precision": config.lm_head_precision, "seed": config.seed,
                                      "dtype": resolve_dtype(config.dtype, placement.cpu_kernels)}
        if config.max_seq_len:
            overrides["max_seq_len"] = config.max_seq_len
        # Built on the CPU from the seeded CPU generator, then moved: every device
        # serves the same weights.
        model = HybridModel(HybridConfig.preset(config.preset).with_overrides(**overrides))
    dtype: str = getattr(model.config, "dtype", "float32")
    native_kernels = select_kernels(placement.cpu_kernels, model)  # off before a move: CPU-only
    if placement.device != "cpu":
        model.to(placement.device)  # a model passed in moves too: the engine owns where it runs
    if config.quantization != "none" or getattr(model, "quantization", "none") != "none":
        from refstack.model.quant import apply_quantization

        # W8A8: calibrated, smoothed and quantised here, where it runs (once per model).
        apply_quantization(model, config.quantization)
    if hasattr(model, "use_kda_decode_kernel"):
        model.use_kda_decode_kernel(placement.kda_decode_kernel)
    if hasattr(model, "configure_ep"):
        from refstack.model.moe import EPSettings

        model.configure_ep(EPSettings(release_gil=config.ep_release_gil, link_gbps=config.ep_link_gbps))
    return ServedModel(model, dtype, placement.device, native_kernels)


def cache_storage(config: EngineConfig, model_config: Any) -> dict[str, Any]:
    """``new_cache``'s storage-type arguments (``kv_cache_dtype``, ``kv_cache_dtype_layers``,
    ``kda_state_dtype``); none at the defaults, so a model given that does not take them
    still gets the call it always got."""
    if config.kv_cache_dtype == "auto" and not config.kv_cache_dtype_layers and config.kda_state_dtype == "fp32":
        return {}
    from refstack.model.kv_dtypes import resolve_kv_dtypes

    return {"kv_dtypes": resolve_kv_dtypes(config.kv_cache_dtype, config.kv_cache_dtype_layers, model_config),
            "state_dtype": config.kda_state_dtype}


def unsampleable_ids(tokenizer: Any, vocab: int) -> torch.Tensor:
    """A [vocab] mask of the ids never sampled: those the tokenizer cannot print (padding
    past its vocabulary) and those that only frame a prompt (``prompt_only_ids``)."""
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[min(tokenizer.vocab_size, vocab):] = True
    for tid in getattr(tokenizer, "prompt_only_ids", ()):
        mask[tid] = True
    return mask
