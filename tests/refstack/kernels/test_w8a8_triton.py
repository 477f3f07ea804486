"""The fused W8A8 GEMM (``refstack.kernels.w8a8_triton``) gives the unfused path's bits:
``quantize_rows``, an exact int32 product and ``dequantize``.

- On the CPU, the real kernel under ``TRITON_INTERPRET=1`` (Triton's interpreter must be
  switched on before Triton is imported, hence a subprocess): one GEMM and a batch of
  experts, with and without the explicit 1/s, fp32 and bf16 inputs, an all-zero row,
  sizes that are not multiples of the blocks.
- On CUDA (skipped without one): the same, then a quantised model's Linears and padded
  experts through it against the unfused ``torch._int_mm`` path on the same device.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest
import torch

HAVE_TRITON = importlib.util.find_spec("triton") is not None
pytestmark = pytest.mark.skipif(not HAVE_TRITON, reason="triton is not installed (the gpu extra)")

CHECK = textwrap.dedent("""
    import json, sys, torch
    from refstack.kernels.w8a8_triton import w8a8_matmul
    from refstack.model.quant_ops import dequantize, quantize_rows, quantize_weight

    device = sys.argv[1]
    gen = torch.Generator().manual_seed(0)
    out = []
    for E, M, K, N, explicit, dtype in [(1, 3, 128, 96, False, torch.float32), (1, 5, 100, 70, True, torch.float32),
                                        (3, 17, 64, 40, True, torch.float32), (2, 4, 64, 64, False, torch.bfloat16),
                                        (2, 33, 96, 130, True, torch.bfloat16)]:
        x = (torch.randn(E, M, K, generator=gen) * 3).to(dtype)
        x[0, 0] = 0  # an all-zero row: scale 0, codes 0
        x[-1, -1, 5] = 40.0  # an outlier sets its row's scale
        w = torch.randn(E, N, K, generator=gen)
        codes = [quantize_weight(w[e]) for e in range(E)]
        q, s = torch.stack([c for c, _ in codes]), torch.stack([c for _, c in codes])
        inv_s = torch.rand(E, K, generator=gen) + 0.5 if explicit else None
        want = []
        for e in range(E):
            xq, sx = quantize_rows(x[e], inv_s[e] if explicit else None)
            want.append(dequantize((xq.long() @ q[e].t().long()).int(), sx, s[e]))
        want = torch.stack(want)
        dev = lambda t: None if t is None else t.to(device)
        got = w8a8_matmul(dev(x), dev(q).transpose(1, 2), dev(s), dev(inv_s)).cpu()
        one = w8a8_matmul(dev(x[0]), dev(q[0]).t(), dev(s[0]), dev(inv_s[0]) if explicit else None).cpu()
        out.append({"shape": [E, M, K, N], "equal": bool(torch.equal(got, want)), "equal_2d": bool(torch.equal(one, want[0])),
                    "max_err": float((got - want).abs().max())})
    print(json.dumps(out))
""")


def _run(device: str, env: dict[str, str]) -> list[dict[str, object]]:
    import json

    r = subprocess.run([sys.executable, "-c", CHECK, device], capture_output=True, text=True, timeout=300,
                       env=env, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_interpreted_kernel_gives_the_unfused_paths_bits() -> None:
    if torch.cuda.is_available():
        # The real kernel is tested below; and Triton 3.6's interpreter (seen on a GPU
        # machine) cannot run a loop bound by a kernel argument under numpy 2.5.
        pytest.skip("interpreter path is checked on CPU-only machines")
    results = _run("cpu", {**os.environ, "TRITON_INTERPRET": "1"})
    assert len(results) == 5
    assert all(r["equal"] and r["equal_2d"] for r in results), results


def test_bad_operands_are_refused_before_launch() -> None:
    from refstack.kernels.w8a8_triton import w8a8_matmul

    x = torch.randn(4, 32)
    with pytest.raises(ValueError, match="int8 codes"):
        w8a8_matmul(x, torch.zeros(32, 8, dtype=torch.float32), torch.ones(8))
    with pytest.raises(ValueError, match="inv_s"):
        w8a8_matmul(x, torch.zeros(32, 8, dtype=torch.int8), torch.ones(8), torch.ones(31))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_kernel_gives_the_unfused_paths_bits() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    results = _run("cuda", env)
    assert all(r["equal"] and r["equal_2d"] for r in results), results


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_quantised_models_gemms_on_cuda_take_the_fused_kernel_with_the_cpus_bits() -> None:
    """A quantised model's Linear and experts on CUDA (one fused launch per GEMM, all the
    experts of a padded buffer in one) give the CPU torch path's bits.  (The unfused path
    on CUDA does not: torch's CUDA division by a scalar multiplies by its reciprocal, so
    its per-row scales can differ from the CPU's in the last bit.)"""
    import copy

    from refstack.model import HybridConfig, HybridModel, quant, quant_layers

    model = HybridModel(HybridConfig.preset("tiny", dtype="float32"))
    quant.quantize_model(model)
    gen = torch.Generator().manual_seed(1)
    lin = next(m for m in model.modules() if isinstance(m, quant_layers.QuantizedLinear))
    experts = next(m.w8a8 for m in model.modules() if isinstance(getattr(m, "w8a8", None), quant_layers.QuantizedExperts))
    x = torch.randn(7, lin.in_features, generator=gen)
    buf = torch.randn(experts.q_down.shape[0], 5, experts.q_gate_up.shape[2], generator=gen)
    buf[:, 3:] = 0  # padded rows
    on_cpu = (lin(x), experts.padded(buf, 0), experts.expert(1, buf[1]))
    lin_gpu, experts_gpu = copy.deepcopy(lin).to("cuda"), copy.deepcopy(experts).to("cuda")
    on_gpu = (lin_gpu(x.cuda()), experts_gpu.padded(buf.cuda(), 0), experts_gpu.expert(1, buf[1].cuda()))
    for a, b in zip(on_gpu, on_cpu):
        assert torch.equal(a.cpu(), b)
