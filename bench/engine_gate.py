"""The correctness gate of ``bench/engine_throughput.py``: no speed figure without it.

Teacher-forced logits on the bench's own prompts (a prefill, then ``steps`` decode
steps fed the reference's greedy tokens, so every model sees the same inputs):

- refstack's native kernels against its torch path, same weights and dtype: at each
  position (prompt, step), the largest logit difference, over the largest |logit| of
  all positions, must stay under ``SAME_DTYPE_TOL`` for the dtype, at ``MIN_CLOSE`` of
  the positions.  fp32 differs only in summation order; bf16 also rounds each GEMM's
  input rows to bf16, and a value on a rounding boundary in one path can round one bf16
  ulp (2^-8 relative) the other way, so its bound is 2^-7.  Not every position, because
  the MoE router is a discrete choice: where a token's 2nd and 3rd expert logits nearly
  tie, a 1e-3 change upstream picks the other expert.  (Seen on the ``small`` preset in
  bf16: one position of 72 off by 6% of the logit range, its router margin at layer 5
  was 6e-4, every other position within 3e-3.)
- for bf16, the bf16 model against the fp32 one (torch path, same seed): the greedy
  token must agree at ``MIN_TOP1_BF16`` of the positions; the RMS difference is printed.

A failed check raises ``SystemExit`` with what differed, before anything is timed.
"""

from __future__ import annotations

import torch
from torch import Tensor

from refstack.model import HybridModel, SeqChunk

SAME_DTYPE_TOL = {"float32": 1e-5, "bfloat16": 2.0**-7}
MIN_CLOSE = 0.95
MIN_TOP1_BF16 = 0.95


@torch.inference_mode()
def teacher_forced(model: HybridModel, prompts: list[list[int]], steps: int,
                   feed: list[list[int]] | None = None) -> tuple[Tensor, list[list[int]]]:
    """Logits ``[steps + 1, len(prompts), vocab]`` and the tokens fed at each decode step
    (``feed``, or this model's own greedy tokens when None)."""
    cache = model.new_cache(num_slots=len(prompts), max_seq_len=max(map(len, prompts)) + steps + 1)
    out = [model.forward_chunks([SeqChunk(i, p, 0) for i, p in enumerate(prompts)], cache)]
    fed: list[list[int]] = []
    for s in range(steps):
        step = feed[s] if feed is not None else out[-1].argmax(-1).tolist()
        fed.append(step)
        out.append(model.forward_chunks([SeqChunk(i, [t], len(p) + s) for i, (p, t) in enumerate(zip(prompts, step))],
                                        cache))
    return torch.stack(out), fed


def check_gate(native: HybridModel, reference: HybridModel, prompts: list[list[int]], steps: int = 8) -> list[str]:
    """Run the checks above (``native`` on its native kernels, ``reference`` on torch's,
    same config); returns one line per check, raises ``SystemExit`` on a failure."""
    dtype = native.config.dtype
    ref_logits, fed = teacher_forced(reference, prompts, steps)
    ours, _ = teacher_forced(native, prompts, steps, fed)
    rel = (ours - ref_logits).abs().amax(-1) / ref_logits.abs().amax()  # [steps + 1, prompts]
    close = (rel <= SAME_DTYPE_TOL[dtype]).float().mean().item()
    first = (f"native vs torch path, {dtype}: |logit diff| / max |logit| <= {SAME_DTYPE_TOL[dtype]:.1e} at {close:.1%} "
             f"of {rel.numel()} positions (limit {MIN_CLOSE:.0%}; median {rel.median().item():.1e}, max "
             f"{rel.max().item():.1e}; {len(prompts)} prompts, prefill + {steps} decode steps)")
    lines = [first]
    if not close >= MIN_CLOSE:
        raise SystemExit(f"correctness gate failed: {lines[0]}")
    if dtype == "bfloat16":
        fp32 = HybridModel(reference.config.with_overrides(dtype="float32"))
        fp32.use_native_kernels(False)
        full, _ = teacher_forced(fp32, prompts, steps, fed)
        top1 = (ours.argmax(-1) == full.argmax(-1)).float().mean().item()
        rms = ((ours - full).pow(2).mean().sqrt() / full.pow(2).mean().sqrt()).item()
        lines.append(f"bf16 vs fp32 model: greedy token agrees at {top1:.1%} of positions (limit {MIN_TOP1_BF16:.0%}), "
                     f"RMS logit diff / RMS logit = {rms:.2e}")
        if not top1 >= MIN_TOP1_BF16:
            raise SystemExit(f"correctness gate failed: {lines[-1]}")
    return lines
