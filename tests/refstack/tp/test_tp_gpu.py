"""``--tp 2 --device cuda``: the same checks as on the CPU, on a GPU.

With one GPU both ranks share it.  NCCL refuses two ranks on one device, so the data
collectives then run through gloo with host staging (``refstack.tp.comm``; the
startup line and GET /debug/engine say which); with two or more GPUs each rank takes
its own and the collectives are NCCL's.  Either way this checks correctness, not a
multi-GPU speed-up.

    python -m pytest -q tests/refstack/tp/test_tp_gpu.py -m gpu
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import httpx
import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
GPU = ("--device", "cuda", "--kda-decode-kernel", "torch", "--torch-threads", "1")


def _pair(factory: Any, *flags: str) -> tuple[Any, Any]:
    return factory([*GPU, "--tp", "1", *flags]), factory([*GPU, "--tp", "2", *flags])


def test_tp2_on_cuda_serves_the_greedy_tokens_of_tp1(refstack_server_factory: Any, agreement: ModuleType) -> None:
    single, tp = _pair(refstack_server_factory, "--seed", "0")
    info = httpx.get(tp.url + "/debug/engine", timeout=10).json()
    assert info["device"] == "cuda"
    assert info["tp"]["backend"] == ("nccl" if torch.cuda.device_count() >= 2 else "gloo"), info["tp"]
    assert agreement.greedy(tp.url) == agreement.greedy(single.url)
    diff = agreement.difference(agreement.echo(single.url), agreement.echo(tp.url))
    assert diff.worst_excess <= 0 and not diff.top1_flips, diff.describe()


def test_case_a_on_cuda(refstack_server_factory: Any, agreement: ModuleType) -> None:
    """tf32 (Triton, truncating inputs and accumulator) disagrees beyond the fp32 bound;
    3xtf32 agrees within it."""
    found = {}
    for precision in ("tf32", "3xtf32"):
        single, tp = _pair(refstack_server_factory, "--seed", "7", "--lm-head-precision", precision)
        found[precision] = agreement.difference(agreement.echo(single.url), agreement.echo(tp.url))
        single.stop()
        tp.stop()
    report = f"tf32 {found['tf32'].describe()}; 3xtf32 {found['3xtf32'].describe()}"
    print(report)
    assert found["tf32"].worst_excess > 0, report
    assert found["3xtf32"].worst_excess <= 0, report
