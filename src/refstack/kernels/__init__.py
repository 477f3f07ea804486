"""refstack's compute kernels: PyTorch reference paths that run anywhere, and Triton
kernels used on CUDA devices.

Modules (import the one you need; nothing here imports Triton at import time):

- ``precision``   -- ``matmul(a, b, precision)`` for fp32 / tf32 / 3xtf32 / bf16;
- ``tp``          -- tensor-parallel LM head and KDA projections, N ranks simulated
  in one process;
- ``tp_dist``     -- the same over a real ``torch.distributed`` group (gloo / NCCL);
- ``triton_gemm`` -- the Triton GEMM behind ``precision.matmul`` on CUDA (host side;
  its device code is ``triton_gemm_kernels``).
"""

from __future__ import annotations

from refstack.kernels.precision import PRECISIONS, matmul, split_tf32, tf32_truncate

__all__ = ["PRECISIONS", "matmul", "split_tf32", "tf32_truncate"]
