"""ReplaySSM (and the snapshot baseline) give back the exact states the forward pass had.

Tolerance: the reference is ``kda_naive`` in fp64 on the same (fp32) inputs; the stores
compute in fp32.  Each step's dot products over K round at ~sqrt(K) * 6e-8 relative,
and the step map is non-expansive (decay <= 1; I - beta k k^T with |k| = 1, beta in
[0, 1]), so rounding does not compound: 300 steps at K = V = 128 stay below 5e-7 on
states of magnitude ~1.  ``ATOL = RTOL = 1e-5`` leaves a 20x margin over that while a
single wrongly replayed or skipped step (an O(0.1) change) still fails by 4 decades.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from refstack.model.kda_ops import kda_chunked, kda_naive
from refstack.model.replay_ssm import ReplaySSM, SnapshotSSM

ATOL = RTOL = 1e-5
N, H, K, V = 3, 2, 16, 8
SCALE = K**-0.5


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """Tiny tensors: a second thread only adds sync, and on a busy box it costs seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def inputs(T: int, n: int = N, k_dim: int = K, v_dim: int = V, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """[T, n, H, ...] fp32 inputs shaped like KDALayer.project's."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(T, n, H, k_dim, generator=gen), dim=-1)
    k = F.normalize(torch.randn(T, n, H, k_dim, generator=gen), dim=-1)
    v = torch.randn(T, n, H, v_dim, generator=gen)
    g = -0.3 * torch.rand(T, n, H, k_dim, generator=gen)
    return q, k, v, g, torch.rand(T, n, H, generator=gen)


def naive_history(xs: tuple[torch.Tensor, ...], s0: torch.Tensor) -> list[torch.Tensor]:
    """The fp64 states [n, H, K, V] at positions 0..T, one kda_naive step at a time."""
    states = [s0.double()]
    for t in range(xs[0].shape[0]):
        step = [torch.stack([kda_naive(*(x[t : t + 1, i].double() for x in xs), states[-1][i], SCALE)[1]])
                for i in range(s0.shape[0])]
        states.append(torch.cat(step))
    return states


def make(kind: str, states: torch.Tensor, window: int) -> ReplaySSM | SnapshotSSM:
    if kind == "snapshot":
        return SnapshotSSM(states, window)
    fold_batch, chunked_from = {"replay": (1, None), "replay-fold3": (3, 2), "replay-chunked": (1, 1)}[kind]
    return ReplaySSM(states, window, fold_batch=fold_batch, chunked_from=chunked_from)


KINDS = ["replay", "replay-fold3", "replay-chunked", "snapshot"]


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 0, 1]], ids=["consecutive", "gathered"])
@pytest.mark.parametrize("kind", KINDS)
def test_every_retained_position_matches_naive(kind: str, order: list[int]) -> None:
    """Consecutive slots take the in-place path, others the gather/scatter one."""
    window, T = 4, 20
    xs = inputs(T)
    s0 = torch.randn(N, H, K, V)  # a non-zero start, as after a prefill
    ref = naive_history(xs, s0)
    store = make(kind, s0.clone(), window)
    for t in range(T):
        store.append(order, *(x[t, order] for x in xs))
        assert store.retained(0) >= min(window, t + 1)
        torch.testing.assert_close(store.states.double(), ref[t + 1], atol=ATOL, rtol=RTOL)
        for back in range(store.retained(0) + 1):
            got = store.state_at(order, back).double()
            torch.testing.assert_close(got, ref[t + 1 - back][order], atol=ATOL, rtol=RTOL, msg=f"t={t} back={back}")


@pytest.mark.parametrize("kind", KINDS)
def test_rollback_per_slot_then_continue(kind: str) -> None:
    """Slots roll back by different amounts in one call, then decode on a new branch."""
    window = 4
    xs, branch = inputs(10), inputs(3, seed=1)
    store = make(kind, torch.zeros(N, H, K, V), window)
    for t in range(10):
        store.append([0, 1, 2], *(x[t] for x in xs))
    back = [0, 1, 3]
    store.rollback([2, 0, 1], [back[2], back[0], back[1]])  # not consecutive: the gather/scatter path
    assert [store.retained(s) for s in range(N)] == [window - b for b in back]
    for t in range(3):
        store.append([0, 1, 2], *(x[t] for x in branch))
    for slot, b in enumerate(back):
        # the slot's history: the first 10 - b steps, then the branch
        hist = tuple(torch.cat([x[: 10 - b, slot : slot + 1], y[:, slot : slot + 1]]) for x, y in zip(xs, branch))
        ref = naive_history(hist, torch.zeros(1, H, K, V))
        torch.testing.assert_close(store.states[slot : slot + 1].double(), ref[-1], atol=ATOL, rtol=RTOL)
        got = store.state_at(slot, store.retained(slot)).double()
        torch.testing.assert_close(got, ref[-1 - store.retained(slot)], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("kind", KINDS)
def test_append_multi_step_chunks_and_outputs(kind: str) -> None:
    """append takes T steps at once ([n, T, H, D]) and returns the decode outputs."""
    xs = inputs(6)
    store = make(kind, torch.zeros(N, H, K, V), 4)
    outs = [store.append([0, 1, 2], *(x[c : c + 2].transpose(0, 1) for x in xs)) for c in (0, 2, 4)]
    o = torch.cat(outs, dim=1)  # [N, 6, H, V]
    zero = torch.zeros(H, K, V, dtype=torch.float64)
    for i in range(N):
        o_ref, _ = kda_naive(*(x[:, i].double() for x in xs), zero, SCALE)
        torch.testing.assert_close(o[i].double(), o_ref, atol=ATOL, rtol=RTOL)
    ref = naive_history(xs, torch.zeros(N, H, K, V))
    for back in range(store.retained(0) + 1):
        torch.testing.assert_close(store.state_at([0, 1, 2], back).double(), ref[6 - back], atol=ATOL, rtol=RTOL)


def test_record_after_external_verify_chunk() -> None:
    """Speculative decoding: the caller's kernel runs a 3-token verify chunk; 2 are rejected."""
    window = 4
    xs = inputs(7, n=1)
    live = torch.zeros(1, H, K, V)
    store = ReplaySSM(live, window)
    for t in range(4):
        store.append([0], *(x[t] for x in xs))
    chunk = [x[4:7].transpose(0, 1) for x in xs]  # [1, 3, H, ...]
    _, live[:] = kda_chunked(*chunk, live, SCALE, chunk_size=16)
    store.record([0], *chunk[1:])
    store.rollback(0, 2)
    ref = naive_history(tuple(x[:5] for x in xs), torch.zeros(1, H, K, V))
    torch.testing.assert_close(live.double(), ref[5], atol=ATOL, rtol=RTOL)
    assert store.retained(0) == window - 2


def test_long_run_does_not_drift() -> None:
    """The checkpoint is folded 300 times in fp32 apart from the live state: still exact."""
    window, T = 2, 300
    xs = inputs(T, n=1, k_dim=64, v_dim=64, seed=2)
    ref = naive_history(xs, torch.zeros(1, H, 64, 64))
    store = ReplaySSM(torch.zeros(1, H, 64, 64), window)
    for t in range(T):
        store.append(0, *(x[t] for x in xs))
    for back in range(window + 1):
        torch.testing.assert_close(store.state_at(0, back).double(), ref[T - back], atol=ATOL, rtol=RTOL)


def test_reset_takes_the_live_state_as_checkpoint() -> None:
    store = ReplaySSM(torch.zeros(N, H, K, V), 2)
    xs = inputs(3)
    for t in range(3):
        store.append([0, 1, 2], *(x[t] for x in xs))
    store.states[1] = 5.0  # e.g. a prefill wrote the slot
    store.reset(1)
    assert store.retained(1) == 0 and store.retained(0) == 2
    torch.testing.assert_close(store.state_at(1, 0), torch.full((1, H, K, V), 5.0))


def test_bytes_per_slot() -> None:
    states = torch.zeros(N, H, K, V)
    assert ReplaySSM(states, 2).chunked_from is None  # "auto" on CPU: the recurrent loop
    state_bytes = H * K * V * 4
    assert SnapshotSSM(states, 8).bytes_per_slot() == 8 * state_bytes
    assert ReplaySSM(states, 8).bytes_per_slot() == state_bytes + 8 * H * (2 * K + V + 1) * 4
    assert ReplaySSM(states, 8, fold_batch=4).bytes_per_slot() == state_bytes + 11 * H * (2 * K + V + 1) * 4
    assert ReplaySSM(states, 8, input_dtype=torch.bfloat16).bytes_per_slot() == state_bytes + 8 * H * (2 * K + V + 1) * 2


@pytest.mark.parametrize("kind", ["replay", "snapshot"])
def test_bad_input_says_what_and_where(kind: str) -> None:
    store = make(kind, torch.zeros(N, H, K, V), 2)
    q, k, v, g, beta = (x[0] for x in inputs(1))
    name = type(store).__name__
    store.append([0, 1, 2], q, k, v, g, beta)
    with pytest.raises(ValueError, match=rf"{name}\.rollback: slot 1: cannot go back 2 steps, only 1 retained"):
        store.rollback([0, 1], [1, 2])
    with pytest.raises(ValueError, match=rf"{name}\.rollback: slot 0: steps must be >= 0"):
        store.rollback(0, -1)
    with pytest.raises(ValueError, match=rf"{name}\.rollback: 2 step counts for 3 slots"):
        store.rollback([0, 1, 2], [1, 1])
    with pytest.raises(ValueError, match=rf"{name}\.state_at: unknown slot 3 \(pool has slots 0\.\.2\)"):
        store.state_at([0, 3], 0)
    with pytest.raises(ValueError, match=rf"{name}\.append: unknown slot -1"):
        store.append([-1, 0, 1], q, k, v, g, beta)
    with pytest.raises(ValueError, match=rf"{name}\.append: slot listed twice"):
        store.append([0, 0, 1], q, k, v, g, beta)
    with pytest.raises(ValueError, match=rf"{name}\.append: k has shape \(3, 2, 15\), expected \(3, 2, 16\)"):
        store.append([0, 1, 2], q, k[..., :15], v, g, beta)
    with pytest.raises(ValueError, match=rf"{name}\.append: beta has shape \(2, 2\), expected \(3, 2\)"):
        store.append([0, 1, 2], q, k, v, g, beta[:2])
    with pytest.raises(ValueError, match=rf"{name}\.append: 3 steps at once exceed the window of 2"):
        store.append([0, 1, 2], *(x.transpose(0, 1) for x in inputs(3)))
    with pytest.raises(ValueError, match=r"states must be \[slots, H, K, V\]"):
        make(kind, torch.zeros(H, K, V), 2)
    assert store.retained(0) == 1  # the rejected calls changed nothing


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_auto_engine_matches_naive() -> None:
    """On CUDA "auto" replays 4+ steps with kda_chunked: same states within the same tolerance."""
    window, T = 8, 20
    xs = inputs(T)
    ref = naive_history(xs, torch.zeros(N, H, K, V))
    store = ReplaySSM(torch.zeros(N, H, K, V, device="cuda"), window, fold_batch=4)
    assert store.chunked_from == 4
    for t in range(T):
        store.append([0, 1, 2], *(x[t].cuda() for x in xs))
    for back in range(store.retained(0) + 1):
        got = store.state_at([0, 1, 2], back).double().cpu()
        torch.testing.assert_close(got, ref[T - back], atol=ATOL, rtol=RTOL)
