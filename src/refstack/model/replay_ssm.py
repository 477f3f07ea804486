"""Rolling a KDA recurrent state back a few steps: replay from a checkpoint, or snapshots.

Speculative decoding and prefix rollback need a slot's ``[H, K, V]`` fp32 state as of
``s <= window`` steps ago.  :class:`SnapshotSSM` (the baseline) keeps ``window`` states
per slot; :class:`ReplaySSM` keeps one checkpoint plus the last steps' k, g, v, beta,
``H (2K + V + 1)`` elements a step (1/42 of a state at H=32, K=V=128), and replays the
recurrence from the checkpoint.  q is not kept: the state recurrence never reads it.
See docs/replay-ssm.md.

Both manage ONE layer's states for a pool of slots, sharing the live state tensor with
the caller (e.g. ``ModelCache.states[layer]``) and updating it in place; a model keeps
one per KDA layer, since each layer's inputs arise inside its forward.  Slot bookkeeping
lives on the host (whether a fold is due is a host decision anyway, and device ops stay
free of data-dependent control flow): pass slots as ints, a CUDA tensor costs a sync.
Nothing here is CUDA-specific.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from refstack.model.kda_ops import kda_chunked, kda_recurrent_step

Slots = int | Sequence[int] | Tensor
Steps = int | Sequence[int]
Engine = Literal["recurrent", "chunked"]
# Shortest replay worth kda_chunked, per device type (bench/replay_ssm.py, 1-step rollbacks,
# H=32, K=V=128).  H200: a tie at 3 steps, chunked 1.9x faster at 7 (N=128 slots) and
# faster at every N; CPU (H=4, K=V=64): the recurrent loop is faster up to 7 steps at N >= 8.
CHUNKED_FROM: dict[str, int | None] = {"cuda": 4, "cpu": None}


def kda_steps(state: Tensor, q: Tensor | None, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float,
              engine: Engine) -> tuple[Tensor | None, Tensor]:
    """T steps from ``state`` [n, H, K, V]; q, k, g [n, T, H, K], v [n, T, H, V], beta [n, T, H].

    Returns (o [n, T, H, V], or None for a replay, where q is None; new state).  ``state`` must be owned by the caller: the
    recurrent engine updates it in place.  Steps with k = 0 and g = 0 leave the state
    untouched, which is how shorter replays are padded into one batch.
    """
    # A replay passes q = k: any q gives the same state, and the output is dropped.
    if engine == "chunked":
        o, state = kda_chunked(k if q is None else q, k, v, g, beta, state, scale, chunk_size=64)
        return (None if q is None else o), state
    outs = []
    for t in range(k.shape[1]):
        qt = k[:, t] if q is None else q[:, t]
        o, state = kda_recurrent_step(qt, k[:, t], v[:, t], g[:, t], beta[:, t], state, scale, inplace=True)
        outs.append(o)
    return (None if q is None else torch.stack(outs, dim=1)), state


class _Rollback:
    """What both stores share: the live state, slot and shape checks, per-slot ring counters."""

    def __init__(self, states: Tensor, window: int, capacity: int, name: str) -> None:
        if states.dim() != 4:
            raise ValueError(f"{name}: states must be [slots, H, K, V], got shape {tuple(states.shape)}")
        if window < 1:
            raise ValueError(f"{name}: window must be >= 1, got {window}")
        self.name = name
        self.states = states  # the live state, shared with the caller
        self.num_slots, self.H, self.K, self.V = states.shape
        self.window = window
        self.capacity = capacity
        self.start = np.zeros(self.num_slots, dtype=np.int64)  # ring index of the oldest entry
        self.count = np.zeros(self.num_slots, dtype=np.int64)  # entries held per slot

    def _slots(self, slots: Slots, where: str) -> np.ndarray:
        raw = slots.tolist() if isinstance(slots, Tensor) else slots
        arr = np.atleast_1d(np.asarray(raw, dtype=np.int64))
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"{self.name}.{where}: slots must be an int or a non-empty 1-D list, got {raw!r}")
        bad = arr[(arr < 0) | (arr >= self.num_slots)]
        if bad.size:
            raise ValueError(f"{self.name}.{where}: unknown slot {int(bad[0])} (pool has slots 0..{self.num_slots - 1})")
        if np.unique(arr).size != arr.size:
            raise ValueError(f"{self.name}.{where}: slot listed twice in {arr.tolist()}")
        return arr

    def _index(self, arr: np.ndarray) -> Tensor:
        return torch.from_numpy(arr).to(self.states.device)

    def _rows(self, arr: np.ndarray) -> slice | Tensor:
        """A slice for a run of consecutive slots (the usual decode batch), else an index.

        A slice gives views that are updated in place: a state-sized gather and
        scatter saved per call, which is most of the cost of a one-step fold.
        """
        lo = int(arr[0])
        return slice(lo, lo + arr.size) if np.array_equal(arr, np.arange(lo, lo + arr.size)) else self._index(arr)

    def _read(self, t: Tensor, rows: slice | Tensor) -> Tensor:
        return t[rows] if isinstance(rows, slice) else t.index_select(0, rows)

    def _write(self, t: Tensor, rows: slice | Tensor, value: Tensor) -> None:
        if not isinstance(rows, slice):
            t.index_copy_(0, rows, value)
        elif value.data_ptr() != t[rows].data_ptr():  # a view already updated in place needs no copy
            t[rows] = value

    def _steps(self, arr: np.ndarray, steps: Steps, where: str) -> np.ndarray:
        st = np.asarray(steps, dtype=np.int64)
        st = np.full(arr.shape, int(st)) if st.ndim == 0 else st
        if st.shape != arr.shape:
            raise ValueError(f"{self.name}.{where}: {st.size} step counts for {arr.size} slots")
        for slot, s, held in zip(arr.tolist(), st.tolist(), self.count[arr].tolist()):
            if s < 0:
                raise ValueError(f"{self.name}.{where}: slot {slot}: steps must be >= 0, got {s}")
            if s > held:
                raise ValueError(f"{self.name}.{where}: slot {slot}: cannot go back {s} steps, only {held} retained "
                                 f"(window {self.window})")
        return st

    def _check_step_inputs(self, n: int, where: str, **xs: Tensor) -> int:
        """Shapes [n, H, D] for one step or [n, T, H, D] for T (beta: no D); returns T."""
        first = next(iter(xs.values()))
        T = first.shape[1] if first.dim() == 4 else 1
        steps = (T,) if first.dim() == 4 else ()
        for arg, x in xs.items():
            want = (n, *steps, self.H, *{"beta": (), "v": (self.V,)}.get(arg, (self.K,)))
            if tuple(x.shape) != want:
                raise ValueError(f"{self.name}.{where}: {arg} has shape {tuple(x.shape)}, expected {want} "
                                 f"({n} slots, {T} step(s), H={self.H}, K={self.K}, V={self.V})")
            if x.device != self.states.device:
                raise ValueError(f"{self.name}.{where}: {arg} is on {x.device}, the states on {self.states.device}")
        if T > self.window:
            raise ValueError(f"{self.name}.{where}: {T} steps at once exceed the window of {self.window}")
        return T

    def retained(self, slot: int) -> int:
        """How many steps ``slot`` can be rolled back right now."""
        return int(self.count[self._slots(slot, "retained")[0]])

    def _restore(self, arr: np.ndarray, steps: np.ndarray) -> None:
        """Write the states of ``steps`` steps ago into the live states of the slots."""
        raise NotImplementedError

    @torch.inference_mode()
    def rollback(self, slots: Slots, steps: Steps) -> None:
        """Restore the live state of each slot to ``steps`` steps ago (per slot, or one for all)."""
        arr = self._slots(slots, "rollback")
        st = self._steps(arr, steps, "rollback")
        self._restore(arr, st)
        self.count[arr] -= st  # the undone steps are forgotten: the ring's tail moves back

    @torch.inference_mode()
    def reset(self, slots: Slots) -> None:
        """Start tracking the slots from their current live state (after a prefill or a new sequence)."""
        self.count[self._slots(slots, "reset")] = 0


class ReplaySSM(_Rollback):
    """One layer's checkpoint states and input rings for a pool of slots.

    Invariant per slot: the live state equals the checkpoint advanced by the ``count``
    retained inputs.  When a record would overflow the ring (``window + fold_batch - 1``
    steps), the oldest inputs are folded into the checkpoint so that ``window`` remain:
    ``fold_batch = 1`` folds one step every step; a larger batch folds less often, in one
    replay, for ``fold_batch - 1`` extra steps of inputs per slot (and up to as many more
    steps to replay on a rollback).

    ``input_dtype`` (default: the states') is the ring's: it should hold exactly what the
    kernel consumed, so a narrower dtype than the kernel's inputs makes replay inexact.

    Replays (and multi-step appends) shorter than ``chunked_from`` steps run the
    recurrent step in a loop, longer ones ``kda_chunked``, which reads the state a few
    times per chunk instead of per step but pads to 16 steps and pays a triangular
    solve.  ``"auto"`` takes the crossover bench/replay_ssm.py measured (CHUNKED_FROM).
    """

    def __init__(self, states: Tensor, window: int, fold_batch: int = 1, input_dtype: torch.dtype | None = None,
                 chunked_from: int | None | Literal["auto"] = "auto", scale: float | None = None) -> None:
        if fold_batch < 1:
            raise ValueError(f"ReplaySSM: fold_batch must be >= 1, got {fold_batch}")
        super().__init__(states, window, window + fold_batch - 1, "ReplaySSM")
        self.chunked_from = CHUNKED_FROM.get(states.device.type) if chunked_from == "auto" else chunked_from
        self.scale = self.K**-0.5 if scale is None else scale
        self.checkpoint = states.detach().clone()
        # One packed ring (k | g | v | beta per head): a record is one scatter, not four.
        width = 2 * self.K + self.V + 1
        self.ring = torch.zeros(self.num_slots, self.capacity, self.H, width, dtype=input_dtype or states.dtype,
                                device=states.device)

    def engine(self, steps: int) -> Engine:
        return "chunked" if self.chunked_from is not None and steps >= self.chunked_from else "recurrent"

    def bytes_per_slot(self) -> int:
        """Bytes held per slot beyond the live state: the checkpoint and the ring."""
        return self.checkpoint[0].nbytes + self.ring[0].nbytes

    def _span(self, arr: np.ndarray, first: np.ndarray, R: int) -> tuple[slice | Tensor, slice | Tensor]:
        """Ring indices of R entries from position ``first`` per slot: plain slices (a view,
        no gather or scatter) when the slots are consecutive, in lockstep and do not wrap."""
        rows, p = self._rows(arr), int(first[0])
        if isinstance(rows, slice) and (first == p).all() and p + R <= self.capacity:
            return rows, slice(p, p + R)
        return self._index(arr)[:, None], self._index((first[:, None] + np.arange(R)) % self.capacity)

    def _gather(self, arr: np.ndarray, lengths: np.ndarray) -> tuple[Tensor, ...]:
        """The first ``lengths`` retained inputs per slot, padded to the longest."""
        R = int(lengths.max())
        packed = self.ring[self._span(arr, self.start[arr], R)].to(self.states.dtype)
        k, g, v, beta = packed.split([self.K, self.K, self.V, 1], dim=-1)
        if (lengths < R).any():
            # Padding steps get k = g = 0: no decay, no delta update, the state is unchanged.
            keep = self._index((np.arange(R) < lengths[:, None]).astype(np.float32)).to(k.dtype)[..., None, None]
            k, g = k * keep, g * keep
        return k, v, g, beta.squeeze(-1)

    def _replay(self, arr: np.ndarray, lengths: np.ndarray, dst: Tensor | None) -> Tensor:
        """The checkpoints of the slots advanced by their first ``lengths`` retained inputs.

        Written into ``dst``'s rows of the slots (the checkpoints themselves for a fold,
        the live states for a rollback), in place when the slots are consecutive; with
        ``dst`` None, returned as a new tensor.
        """
        rows = self._index(arr) if dst is None else self._rows(arr)
        state = self._read(self.checkpoint, rows)
        if isinstance(rows, slice) and dst is not None and dst is not self.checkpoint:
            state = dst[rows]
            state.copy_(self.checkpoint[rows])
        if lengths.max() > 0:
            k, v, g, beta = self._gather(arr, lengths)
            state = kda_steps(state, None, k, v, g, beta, 1.0, self.engine(int(lengths.max())))[1]
        if dst is not None:
            self._write(dst, rows, state)
        return state

    @torch.inference_mode()
    def record(self, slots: Slots, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
        """Retain the inputs of the steps just taken (or about to be) by the caller's kernel.

        Shapes [n, H, D] for one step or [n, T, H, D] for T <= window steps (a
        speculative verify chunk); the live state is the caller's to advance.
        """
        arr = self._slots(slots, "record")
        self._record(arr, self._check_step_inputs(arr.size, "record", k=k, v=v, g=g, beta=beta), k, v, g, beta)

    def _record(self, arr: np.ndarray, T: int, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> None:
        fold = np.where(self.count[arr] + T > self.capacity, self.count[arr] + T - self.window, 0)
        if fold.any():
            due = arr[fold > 0]
            self._replay(due, fold[fold > 0], self.checkpoint)
            self.start[due] = (self.start[due] + fold[fold > 0]) % self.capacity
            self.count[due] -= fold[fold > 0]
        packed = torch.cat([x.reshape(arr.size, T, self.H, -1) for x in (k, g, v, beta.unsqueeze(-1))], dim=-1)
        self.ring[self._span(arr, (self.start[arr] + self.count[arr]) % self.capacity, T)] = packed.to(self.ring.dtype)
        self.count[arr] += T

    @torch.inference_mode()
    def append(self, slots: Slots, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """Advance the live states by one step ([n, H, D]) or T steps ([n, T, H, D]), record them; returns o."""
        arr = self._slots(slots, "append")
        T = self._check_step_inputs(arr.size, "append", q=q, k=k, v=v, g=g, beta=beta)
        self._record(arr, T, k, v, g, beta)
        rows = self._rows(arr)
        per_step = q.dim() == 3
        qt, kt, vt, gt, bt = (x.unsqueeze(1) if per_step else x for x in (q, k, v, g, beta))
        o, state = kda_steps(self._read(self.states, rows), qt, kt, vt, gt, bt, self.scale, self.engine(T))
        self._write(self.states, rows, state)
        assert o is not None
        return o[:, 0] if per_step else o

    @torch.inference_mode()
    def state_at(self, slots: Slots, steps: Steps) -> Tensor:
        arr = self._slots(slots, "state_at")
        st = self._steps(arr, steps, "state_at")
        return self._replay(arr, self.count[arr] - st, None)

    def _restore(self, arr: np.ndarray, steps: np.ndarray) -> None:
        self._replay(arr, self.count[arr] - steps, self.states)

    @torch.inference_mode()
    def reset(self, slots: Slots) -> None:
        arr = self._slots(slots, "reset")
        rows = self._rows(arr)
        self._write(self.checkpoint, rows, self._read(self.states, rows))
        self.count[arr] = 0


class SnapshotSSM(_Rollback):
    """The baseline: a ring of the states before each of the last ``window`` steps; rollback is a copy."""

    def __init__(self, states: Tensor, window: int, scale: float | None = None) -> None:
        super().__init__(states, window, window, "SnapshotSSM")
        self.scale = self.K**-0.5 if scale is None else scale
        self.snaps = torch.zeros(self.num_slots, window, self.H, self.K, self.V, dtype=states.dtype,
                                 device=states.device)

    def bytes_per_slot(self) -> int:
        return self.snaps[0].nbytes

    @torch.inference_mode()
    def record(self, slots: Slots) -> None:
        """Snapshot the live states; call it BEFORE the kernel advances them by one step."""
        arr = self._slots(slots, "record")
        full = self.count[arr] == self.window
        pos = (self.start[arr] + self.count[arr]) % self.window
        rows = self._rows(arr)
        if isinstance(rows, slice) and (pos == pos[0]).all():  # slots in lockstep: one plain copy
            self.snaps[rows, int(pos[0])] = self.states[rows]
        else:
            self.snaps[self._index(arr), self._index(pos)] = self._read(self.states, rows)
        self.start[arr] = np.where(full, (self.start[arr] + 1) % self.window, self.start[arr])
        self.count[arr] = np.minimum(self.count[arr] + 1, self.window)

    @torch.inference_mode()
    def append(self, slots: Slots, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor) -> Tensor:
        """Same contract as :meth:`ReplaySSM.append`; T steps are taken one by one, each snapshotted."""
        arr = self._slots(slots, "append")
        T = self._check_step_inputs(arr.size, "append", q=q, k=k, v=v, g=g, beta=beta)
        per_step = q.dim() == 3
        rows, outs = self._rows(arr), []
        for t in range(T):
            self.record(arr.tolist())
            qt, kt, vt, gt, bt = (x if per_step else x[:, t] for x in (q, k, v, g, beta))
            o, state = kda_recurrent_step(qt, kt, vt, gt, bt, self._read(self.states, rows), self.scale, inplace=True)
            self._write(self.states, rows, state)
            outs.append(o)
        return outs[0] if per_step else torch.stack(outs, dim=1)

    @torch.inference_mode()
    def state_at(self, slots: Slots, steps: Steps) -> Tensor:
        arr = self._slots(slots, "state_at")
        st = self._steps(arr, steps, "state_at")
        out = self.snaps[self._index(arr), self._index((self.start[arr] + self.count[arr] - st) % self.window)]
        if (st == 0).any():  # zero steps back is the live state, which is not in the ring
            out[torch.from_numpy(st == 0).to(out.device)] = self.states[self._index(arr[st == 0])]
        return out

    def _restore(self, arr: np.ndarray, steps: np.ndarray) -> None:
        arr, steps = arr[steps > 0], steps[steps > 0]  # zero steps back: the live state already is it
        if arr.size == 0:
            return
        pos = (self.start[arr] + self.count[arr] - steps) % self.window
        rows = self._rows(arr)
        if isinstance(rows, slice) and (pos == pos[0]).all():
            self.states[rows] = self.snaps[rows, int(pos[0])]
        else:
            self.states.index_copy_(0, self._index(arr), self.snaps[self._index(arr), self._index(pos)])
