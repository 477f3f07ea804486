"""Where an engine runs: the ``device``, ``cpu_kernels`` and ``kda_decode_kernel`` knobs together.

``resolve_placement`` turns the three knobs into what the engine applies: a concrete
device ("cpu" or "cuda"), the ``cpu_kernels`` choice it hands to ``select_kernels``,
and the KDA decode kernel.  Combinations that cannot run raise ``PlacementError`` with
one line naming the knobs involved; the CLI calls it before building anything, so
``refstack serve`` refuses them at startup instead of failing in the first step.

- The native CPU kernels take only CPU tensors: on cuda ``auto`` means torch's ops and
  ``native`` is refused.  They also replace the KDA layer's torch path, which is where
  the Triton decode kernel plugs in, so ``triton`` makes ``auto`` torch too.
- ``auto`` devices pick cuda when ``torch.cuda.is_available()``, and say which once per
  process (the CLI and the engine both resolve; the answer is cached).
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from refstack.engine.config import EngineConfig

log = logging.getLogger(__name__)


class PlacementError(ValueError):
    """A knob combination this machine cannot run; one line that names the knobs."""


@dataclass(frozen=True, slots=True)
class Placement:
    device: str  # "cpu" or "cuda": weights, caches and step tensors live there
    cpu_kernels: str  # what select_kernels applies: the knob's value, or "torch" where native cannot serve
    kda_decode_kernel: str  # "torch" or "triton"


def _cuda_visible() -> bool:
    import torch  # here: `refstack knobs` and the CLI's arg checks need no torch

    return bool(torch.cuda.is_available())


@functools.cache
def _auto_device() -> str:
    """cuda when one is visible, else cpu; logged on the first call only."""
    if _cuda_visible():
        import torch

        # WARNING: the server configures no logging, and Python's last-resort handler
        # shows WARNING and up; which device serves changes every number, so say it.
        log.warning("--device auto: running on cuda (%s)", torch.cuda.get_device_name())
        return "cuda"
    log.warning("--device auto: no CUDA device is visible; running on cpu")
    return "cpu"


def _triton_interpreting() -> bool:
    """TRITON_INTERPRET=1: Triton runs its kernels on CPU tensors (slowly; for tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _kda_kernel_import_error() -> str | None:
    """Why ``refstack.kernels.kda_decode`` cannot be imported, or None when it can."""
    try:
        importlib.import_module("refstack.kernels.kda_decode")
    except ImportError as exc:
        return str(exc)
    return None


def _conflict(config: EngineConfig, device: str, disagg: bool) -> str | None:
    """The first knob combination that cannot run on ``device``, as an error line."""
    if device == "cuda":
        where = f"--device {config.device}" + (" (resolved to cuda)" if config.device == "auto" else "")
        if config.cpu_kernels == "native":
            return (f"--cpu-kernels native with {where}: the native kernels take only CPU tensors; "
                    "pass --cpu-kernels auto or torch, or --device cpu")
        if disagg:
            return (f"--disagg with {where}: the disaggregated workers move KV pages through host memory "
                    "and run on the CPU only; pass --device cpu")
        if config.ep_link_gbps > 0:
            return (f"--ep-link-gbps {config.ep_link_gbps:g} with {where}: the modelled exchange wait runs in "
                    "the native CPU kernels; leave --ep-link-gbps 0 on cuda")
    if config.kda_decode_kernel == "triton":
        if config.cpu_kernels == "native":
            return ("--kda-decode-kernel triton with --cpu-kernels native: the native kernels replace the KDA "
                    "layer's torch path the Triton kernel plugs into; pass --cpu-kernels auto or torch")
        if device == "cpu" and not _triton_interpreting():
            return (f"--kda-decode-kernel triton with --device {config.device}: Triton kernels need a CUDA "
                    "device (or TRITON_INTERPRET=1, Triton's CPU interpreter); pass --device cuda or "
                    "--kda-decode-kernel torch")
    return None


def _cache_conflict(config: EngineConfig, disagg: bool) -> str | None:
    """The cache storage knobs (kv_cache_dtype, kv_cache_dtype_layers, kda_state_dtype):
    a bad layer override (checked against the preset's layers), fp8 on a torch without
    float8 types, or a non-fp32 cache with the disaggregated workers, as an error line."""
    if config.kv_cache_dtype == "auto" and not config.kv_cache_dtype_layers and config.kda_state_dtype == "fp32":
        return None
    # Imported here: the default launch imports no model code for this check.
    from refstack.model.config import HybridConfig
    from refstack.model.kv_dtypes import parse_kv_cache_dtype_layers

    try:
        model = HybridConfig.preset(config.preset)
        layers = parse_kv_cache_dtype_layers(config.kv_cache_dtype_layers, model, f"preset {config.preset}")
    except ValueError as exc:
        return str(exc)
    # (dtype, the knob as given) of every storage choice, for the error lines below
    asked = [(config.kv_cache_dtype, f"--kv-cache-dtype {config.kv_cache_dtype}"),
             *((d, f"--kv-cache-dtype-layers {layer}:{d}") for layer, d in layers.items()),
             (config.kda_state_dtype, f"--kda-state-dtype {config.kda_state_dtype}")]
    fp8 = [knob for d, knob in asked if d == "fp8_e4m3"]
    if fp8:
        import torch

        if not hasattr(torch, "float8_e4m3fn"):
            return (f"{fp8[0]}: this torch ({torch.__version__}) has no float8_e4m3fn type to store it in; "
                    "pass int8 or bf16, or use a torch with float8 types (2.1 or later)")
    # (a default of int8 that every attention layer overrides back to fp32 stores fp32)
    kv_default_used = set(layers) != set(model.full_attention_layers)
    not_fp32 = [knob for d, knob in asked[int(not kv_default_used):] if d not in ("auto", "fp32")]
    if disagg and not_fp32:
        return (f"{not_fp32[0]} with --disagg: the disaggregated workers move KV pages and KDA states as fp32 "
                "bytes; keep the cache fp32 (--kv-cache-dtype auto, --kda-state-dtype fp32) or serve without --disagg")
    return None


def resolve_placement(config: EngineConfig, *, disagg: bool = False) -> Placement:
    """The device and kernels an engine with ``config`` runs; ``PlacementError`` if none.

    Pure knob conflicts are checked before the machine is asked, so an impossible
    combination reads the same on every machine."""
    problem = _cache_conflict(config, disagg)
    if problem:
        raise PlacementError(problem)
    wanted = "cuda" if config.device == "cuda" else "cpu"
    if config.device != "auto":
        problem = _conflict(config, wanted, disagg)
        if problem:
            raise PlacementError(problem)
    if config.device == "cuda" and not _cuda_visible():
        raise PlacementError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False); "
                             "pass --device cpu or --device auto")
    device = _auto_device() if config.device == "auto" else wanted
    problem = _conflict(config, device, disagg) if config.device == "auto" else None
    if problem:
        raise PlacementError(problem)
    if config.kda_decode_kernel == "triton":
        reason = _kda_kernel_import_error()
        if reason:
            raise PlacementError(f"--kda-decode-kernel triton with --device {device}: cannot import the Triton "
                                 f"KDA kernel ({reason}); install triton or pass --kda-decode-kernel torch")
    native_possible = device == "cpu" and config.kda_decode_kernel == "torch"
    kernels = config.cpu_kernels if native_possible else "torch"
    if config.quantization == "w8a8" and kernels == "torch":
        # (imports torch and the model: only when asked for)
        from refstack.model.quant_ops import int_mm_unavailable_reason

        reason = int_mm_unavailable_reason(device)  # W8A8 on torch's path is torch._int_mm
        if reason:
            knob = f"--cpu-kernels {config.cpu_kernels}" if device == "cpu" else f"--device {config.device}"
            raise PlacementError(f"--quantization w8a8 with {knob}: {reason}; pass "
                                 f"{'--cpu-kernels auto or native' if device == 'cpu' else '--device cpu'} "
                                 "or --quantization none")
    return Placement(device, kernels, config.kda_decode_kernel)


def select_kernels(choice: str, model: Any) -> bool:
    """Switch the model's matmuls to the native CPU kernels per the ``cpu_kernels`` knob
    (as ``resolve_placement`` left it); True when they run.

    "native" insists (``NativeKernelsUnavailable`` says why it cannot); "auto" falls
    back to torch with a warning; "torch" keeps torch's matmuls."""
    from refstack.kernels import cpu_kernels

    switch = getattr(model, "use_native_kernels", None)
    if switch is None:  # a model without the switch runs as it is
        return False
    if choice == "torch":
        switch(False)
        return False
    if choice == "auto" and not cpu_kernels.available():
        log.warning("native CPU kernels unavailable (%s); running torch's matmuls", cpu_kernels.unavailable_reason())
        switch(False)
        return False
    switch(True)
    return True
