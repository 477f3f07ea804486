"""The simulated TP kernels against real gloo collectives, 2 CPU processes."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from refstack.kernels import tp, tp_dist

WORLD = 2


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    # A file store, not a TCP port: nothing to collide with on a shared machine.
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        g = torch.Generator().manual_seed(0)  # every rank draws the same full tensors
        o = torch.randn(16, 64, generator=g)
        w_o = torch.randn(64, 64, generator=g) / 8
        w_lm = torch.randn(101, 64, generator=g) / 8  # uneven vocab slices
        out = {}
        for precision in ("fp32", "tf32", "3xtf32"):
            y = tp_dist.row_parallel_linear(tp_dist.local_shard(o, -1), tp_dist.local_shard(w_o, 1), precision)
            logits = tp_dist.vocab_parallel_logits(y, tp_dist.local_shard(w_lm, 0), w_lm.shape[0], precision)
            out[precision] = (y, logits)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_gloo_matches_the_simulation() -> None:
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(os.path.join(d, "store"), d), nprocs=WORLD, join=True)
        results = [torch.load(os.path.join(d, f"rank{r}.pt")) for r in range(WORLD)]
    g = torch.Generator().manual_seed(0)
    o = torch.randn(16, 64, generator=g)
    w_o = torch.randn(64, 64, generator=g) / 8
    w_lm = torch.randn(101, 64, generator=g) / 8
    for precision in ("fp32", "tf32", "3xtf32"):
        y_sim = tp.row_parallel_linear(o, w_o, WORLD, precision)
        logits_sim = tp.vocab_parallel_logits(y_sim, w_lm, WORLD, precision)
        for y, logits in (r[precision] for r in results):
            # Two partials: one rounding, whatever the order -> bitwise equal.
            assert torch.equal(y, y_sim), precision
            assert torch.equal(logits, logits_sim), precision
