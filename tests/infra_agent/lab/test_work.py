from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infra_agent.lab.tiled_kda import (
    gate_flops,
    kda_decode_inputs,
    kda_decode_reference,
    kda_decode_tiled,
    norm_flops,
    tile_flops,
)
from infra_agent.lab.work import WorkCounter

SHAPE = {"N": 2, "H": 3, "K": 16, "V": 128}


def test_counter_total_minus_unique() -> None:
    c = WorkCounter()
    for tile in range(4):
        c.add("norm", 10, key=("s0", "h0"))
        c.add("update", 100, key=("s0", "h0", tile))
    c.add("norm", 10, key=("s0", "h1"))
    ops = {w.op: w for w in c.ops()}
    assert ops["norm"].calls == 5 and ops["norm"].unique_keys == 2
    assert ops["norm"].repeated_flops == 30 and ops["norm"].repeat_factor == 2.5
    assert ops["update"].repeated_flops == 0
    assert [w.op for w in c.repeated()] == ["norm"]
    assert c.total_flops == 450 and c.repeated_flops == 30


@pytest.mark.parametrize("bv", [16, 32, 64, 128])
def test_tiled_kda_repeats_norm_and_gate_v_over_bv_times(bv: int) -> None:
    inputs = kda_decode_inputs(SHAPE, torch.float32, 0, "cpu")
    want = kda_decode_reference(**{k: v.clone() for k, v in inputs.items()})
    counter = WorkCounter()
    got = kda_decode_tiled(**inputs, BV=bv, counter=counter)
    torch.testing.assert_close(got["o"], want["o"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["state"], want["state"], rtol=1e-5, atol=1e-6)

    ops = {w.op: w for w in counter.ops()}
    tiles, keys, K = SHAPE["V"] // bv, SHAPE["N"] * SHAPE["H"], SHAPE["K"]
    for op, per_call in (("l2norm_qk", norm_flops(K)), ("gate", gate_flops(K))):
        assert ops[op].repeat_factor == tiles and ops[op].unique_keys == keys
        assert ops[op].repeated_flops == (tiles - 1) * keys * per_call
    assert ops["state_update"].repeat_factor == 1
    assert ops["state_update"].total_flops == keys * tiles * tile_flops(K, bv)
    assert (counter.repeated_flops == 0) == (bv == SHAPE["V"])


def test_triton_kda_counts_repeats_from_the_kernel() -> None:
    """The Triton twin under the interpreter: outputs match, per-key counts read back."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import json, torch
        from infra_agent.lab.tiled_kda import kda_decode_inputs, kda_decode_reference
        from infra_agent.lab.tiled_kda_triton import kda_decode_triton
        from infra_agent.lab.work import WorkCounter
        shape = {"N": 2, "H": 2, "K": 16, "V": 64}
        out = {}
        for bv in (16, 64):
            inputs = kda_decode_inputs(shape, torch.float32, 1, "cpu")
            want = kda_decode_reference(**{k: v.clone() for k, v in inputs.items()})
            c = WorkCounter()
            got = kda_decode_triton(**inputs, BV=bv, counter=c)
            err = max(float((got[k] - want[k]).abs().max()) for k in ("o", "state"))
            out[bv] = {"err": err, "ops": {w.op: [w.repeat_factor, w.unique_keys] for w in c.ops()}}
        print(json.dumps(out))
        """
    )
    # TRITON_INTERPRET must be set before triton decorates the kernel: a fresh process.
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    res = json.loads(proc.stdout.strip().splitlines()[-1])
    for bv, tiles in (("16", 4), ("64", 1)):
        assert res[bv]["err"] < 1e-5
        assert res[bv]["ops"]["l2norm_qk"] == [tiles, 4] and res[bv]["ops"]["gate"] == [tiles, 4]
