"""What every native-kernel wrapper checks before a tensor's pointer reaches C.

The C functions trust their pointers: a float operand of another dtype would be read as
fp32 garbage, and another device's pointer would crash the process.  The wrappers of
``cpu_kernels``, ``cpu_moe``, ``cpu_kda``, ``cpu_attention`` and ``cpu_blocks`` all check
through these two, so the message a caller gets is the same whichever kernel refused.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_fp32", "check_index"]


def check_fp32(name: str, *tensors: Tensor) -> None:
    """fp32 CPU tensors (every float operand)."""
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"{name}: the native kernels take fp32 CPU tensors, got {t.dtype} on {t.device}")


def check_index(name: str, *tensors: Tensor) -> None:
    """int64 CPU tensors (every index operand: another device's pointer must never reach C)."""
    for t in tensors:
        if t.dtype != torch.int64 or t.device.type != "cpu":
            raise ValueError(f"{name}: index tensors must be int64 on the CPU, got {t.dtype} on {t.device}")
