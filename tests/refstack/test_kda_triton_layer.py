"""The KDA layer with ``kda_decode_kernel=triton``: the decode rows through
``refstack.kernels.kda_decode``, everything else on torch's path.

- In process, with the kernel's float64 reference standing in for it: the layer hands
  the kernel what its contract asks (raw q, k, f, b; eps = K * 1e-12 and scale K^-1/2
  to match torch's rms_norm; the slots' states in place; fresh slots zeroed first), so
  the model's logits match torch's path through prefill, batched decode over
  non-consecutive slots, a reused slot's one-token prompt and a mixed step.
- Over HTTP, the real Triton kernel under TRITON_INTERPRET=1 (Triton's CPU interpreter;
  it must be set before Triton is imported, hence a server subprocess) against a
  torch-path server, with test_device.py's greedy comparison rule.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from torch import Tensor

from refstack.model import HybridConfig, HybridModel, SeqChunk

HAVE_KERNEL = importlib.util.find_spec("triton") is not None and \
    importlib.util.find_spec("refstack.kernels.kda_decode") is not None


def _test_device() -> ModuleType:
    """test_device.py's comparison helpers (test folders are not packages here)."""
    spec = importlib.util.spec_from_file_location("refstack_test_device", Path(__file__).with_name("test_device.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in() -> ModuleType:
    """A ``refstack.kernels.kda_decode`` whose ``kda_decode`` is the contract in float64 torch,
    checking the inputs the contract requires."""
    from refstack.kernels.kda_decode_ref import kda_decode_reference

    def kda_decode(q: Tensor, k: Tensor, v: Tensor, f: Tensor, b: Tensor, state: Tensor, slots: Tensor, *,
                   A_log: Tensor, dt_bias: Tensor | None = None, scale: float | None = None, eps: float = 1e-6,
                   out: Tensor | None = None) -> Tensor:
        assert all(t.is_contiguous() for t in (q, k, v, f, b, state)) and state.dtype == torch.float32
        assert slots.dtype in (torch.int32, torch.int64) and slots.shape == (q.shape[0],)
        o, new = kda_decode_reference(q, k, v, f, b, state, slots, A_log=A_log, dt_bias=dt_bias, scale=scale, eps=eps)
        state[slots.long()] = new.float()
        return o

    module = ModuleType("refstack.kernels.kda_decode")
    module.kda_decode = kda_decode  # type: ignore[attr-defined]
    return module


def test_layer_follows_the_kernel_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "refstack.kernels.kda_decode", _stand_in())
    cfg = HybridConfig.preset("tiny")
    torch_path, kernel_path = HybridModel(cfg), HybridModel(cfg)
    kernel_path.use_kda_decode_kernel("triton")
    caches = [m.new_cache(num_slots=4) for m in (torch_path, kernel_path)]

    def both(chunks: list[SeqChunk]) -> Tensor:
        want, got = (m.forward_chunks(chunks, c) for m, c in zip((torch_path, kernel_path), caches))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        return want

    prompts = {0: [1, 2, 3, 4, 5], 1: [50, 60, 70], 2: [9, 8, 7, 6]}
    logits = both([SeqChunk(s, p, 0) for s, p in prompts.items()])
    next_id = dict(zip(prompts, logits.argmax(-1).tolist()))
    pos = {s: len(p) for s, p in prompts.items()}
    for step in range(4):
        live = [0, 1, 2] if step == 0 else [0, 2]  # then non-consecutive slots: gathered states
        chunks = [SeqChunk(s, [next_id[s]], pos[s]) for s in live]
        if step == 2:
            chunks.insert(1, SeqChunk(1, [33], 0))  # slot 1 reused by a one-token prompt: its stale state must go
        logits = both(chunks)
        next_id.update((c.slot, t) for c, t in zip(chunks, logits.argmax(-1).tolist()))
        for s in live:
            pos[s] += 1
    # A mixed step: decodes (the kernel) beside a new prompt's prefill chunk (torch's chunked path).
    both([SeqChunk(0, [next_id[0]], pos[0]), SeqChunk(2, [next_id[2]], pos[2]), SeqChunk(3, list(range(20, 40)), 0)])

@pytest.mark.skipif(not HAVE_KERNEL, reason="triton or refstack.kernels.kda_decode is not importable")
def test_triton_kernel_under_the_interpreter_matches_the_torch_path(
        refstack_server_factory: Callable[..., Any]) -> None:
    helpers = _test_device()
    prompts = helpers.PROMPTS[:4]
    reference = refstack_server_factory(args=helpers.CPU_REFERENCE)
    triton = refstack_server_factory(args=[*helpers.CPU_REFERENCE[:2], "--dtype", "float32",
                                           "--kda-decode-kernel", "triton"], env={"TRITON_INTERPRET": "1"})
    assert "triton KDA decode" in triton.log()
    helpers.assert_agree(helpers.greedy_all(reference.url, prompts, 12), helpers.greedy_all(triton.url, prompts, 12))
