"""refstack's Triton KDA decode step: correctness against the float64 reference, bad input.

Launches run in a subprocess under ``TRITON_INTERPRET=1`` on the CPU (the variable
must be set before the kernel module is imported), and natively on a GPU when there
is one.  Validation errors are raised before any launch, so they are tested here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from refstack.kernels.kda_decode import KDAShapeError, check_slots, kda_decode  # noqa: E402
from refstack.kernels.kda_decode_ref import kda_decode_inputs, kda_decode_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

INTERPRETED = r"""
import json, torch
from refstack.kernels.kda_decode import LaunchConfig, kda_decode
from refstack.kernels.kda_decode_ref import kda_decode_inputs, kda_decode_reference
out = {}
# The two forms' default configs, then sub-tiles within a program (4 of 16 columns over all of
# V, 2 of 16 over 32 columns), loaded one after another or with the next one prefetched.
configs = {"tiled": None, "fused": None}
for cols in (64, 32):
    for prefetch in (False, True):
        configs[f"cols{cols}-bv16-{'prefetch' if prefetch else 'seq'}"] = LaunchConfig(cols, 16, 1, "", prefetch)
for form, config in configs.items():
    x = kda_decode_inputs(3, 2, 32, 64, num_slots=6, dtype=torch.float32, seed=1)
    state = x["state"].clone()
    o_ref, s_ref = kda_decode_reference(x["q"], x["k"], x["v"], x["f"], x["b"], state, x["slots"],
                                        A_log=x["A_log"], dt_bias=x["dt_bias"])
    counts = torch.zeros(6, dtype=torch.int32)
    o = kda_decode(x["q"], x["k"], x["v"], x["f"], x["b"], state, x["slots"], A_log=x["A_log"],
                   dt_bias=x["dt_bias"], form=form if config is None else "auto", counts=counts, config=config)
    rows = x["slots"].long()
    others = [i for i in range(6) if i not in rows.tolist()]
    out[form] = {
        "err_o": float((o - o_ref).norm() / o_ref.norm()),
        "err_s": float((state[rows] - s_ref).norm() / s_ref.norm()),
        "others_untouched": bool(torch.equal(state[others], x["state"][others])),
        "counts": counts.tolist(),
    }
print(json.dumps(out))
"""


def _interpreted(script: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_both_forms_match_the_reference_under_the_interpreter() -> None:
    out = _interpreted(INTERPRETED)
    expected = {"tiled": 64 // 32, "fused": 1}
    expected.update({f"cols{c}-bv16-{p}": 64 // c for c in (64, 32) for p in ("seq", "prefetch")})
    assert set(out) == set(expected)
    for form, expected_count in expected.items():
        r = out[form]
        # fp32 sums over K=32 against float64: a few ULP of the result's scale.
        assert r["err_o"] < 1e-6 and r["err_s"] < 1e-6, (form, r)
        assert r["others_untouched"], f"{form} wrote a slot it was not given"
        # The kernel's own counters: norm-and-gate computations per (sequence, head).
        assert r["counts"] == [expected_count] * 6, (form, r["counts"])


def _x(**over):  # type: ignore[no-untyped-def]
    x = kda_decode_inputs(2, 2, 32, 32, num_slots=4, dtype=torch.float32)
    x.update(over)
    return x


def _call(x, **kw):  # type: ignore[no-untyped-def]
    return kda_decode(x["q"], x["k"], x["v"], x["f"], x["b"], x["state"], x["slots"], A_log=x["A_log"],
                      dt_bias=x["dt_bias"], **kw)


@pytest.mark.parametrize(
    ("over", "message"),
    [
        ({"q": torch.randn(2, 2, 24), "k": torch.randn(2, 2, 24), "f": torch.randn(2, 2, 24)}, "powers of two"),
        ({"v": torch.randn(2, 2, 16).double()}, "float64"),
        ({"b": torch.randn(2, 3)}, "b has shape"),
        ({"state": torch.zeros(4, 2, 32, 32, dtype=torch.bfloat16)}, "fp32"),
        ({"slots": torch.tensor([0.0, 1.0])}, "slots must be int32/int64"),
        ({"dt_bias": torch.zeros(5)}, "dt_bias"),
    ],
)
def test_unsupported_inputs_are_refused_before_launch(over, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(KDAShapeError, match=message):
        _call(_x(**over))


def test_unknown_form_and_out_of_range_slots() -> None:
    with pytest.raises(KDAShapeError, match="form must be one of"):
        _call(_x(), form="v-tiled")
    with pytest.raises(IndexError, match=r"slot indices \[7\] are outside the state pool of 4 slots"):
        _call(_x(slots=torch.tensor([1, 7], dtype=torch.int32)), debug=True)
    check_slots(torch.tensor([0, 3]), 4)  # in range: no error


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n", [1, 8, 128])
@pytest.mark.parametrize("form", ["tiled", "fused", "auto"])
def test_gpu_matches_reference_at_the_case_study_shape(n: int, form: str) -> None:
    x = kda_decode_inputs(n, 32, 128, 128, num_slots=2 * n, dtype=torch.bfloat16, device="cuda", seed=n)
    state = x["state"].clone()
    o_ref, s_ref = kda_decode_reference(x["q"], x["k"], x["v"], x["f"], x["b"], state, x["slots"],
                                        A_log=x["A_log"], dt_bias=x["dt_bias"])
    o = _call({**x, "state": state}, form=form)
    rows = x["slots"].long()
    # bf16 output: its rounding (2^-9 relative) dominates; the fp32 state is near-exact.
    assert float((o.double() - o_ref.double()).norm() / o_ref.double().norm()) < 5e-3
    assert float((state[rows] - s_ref).norm() / s_ref.norm()) < 1e-5


def test_ascending_slots_are_the_shuffled_subset_sorted_as_the_engine_presents_it() -> None:
    shuffled = kda_decode_inputs(16, 2, 16, 16, num_slots=32, dtype=torch.float32, seed=3)["slots"]
    ascending = kda_decode_inputs(16, 2, 16, 16, num_slots=32, dtype=torch.float32, seed=3,
                                  slot_order="ascending")["slots"]
    assert not torch.equal(shuffled, ascending)  # 16 of 32 in a random order: sorted by chance ~1e-13
    assert torch.equal(torch.sort(shuffled).values, ascending)
    assert ascending.dtype == torch.int32 and len(set(ascending.tolist())) == 16


def test_an_unknown_slot_order_is_refused() -> None:
    with pytest.raises(ValueError, match="slot_order must be one of"):
        kda_decode_inputs(2, 2, 16, 16, slot_order="random")
